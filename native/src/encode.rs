//! Output formats: JSON spelled as pydantic writes it (the json payload column keeps the spelling), and
//! PostgreSQL's binary and text COPY rows.

use crate::avro::Value;

/// Microseconds from the Unix epoch to 2000-01-01 (PostgreSQL's timestamp epoch).
const PG_EPOCH_US: i64 = 946_684_800_000_000;

/// (year, month, day) of a day count since 1970-01-01 (H. Hinnant's civil_from_days).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn push_num(out: &mut Vec<u8>, v: i64, width: usize) {
    let s = v.to_string();
    for _ in s.len()..width {
        out.push(b'0');
    }
    out.extend_from_slice(s.as_bytes());
}

/// `YYYY-MM-DD?HH:MM:SS[.ffffff]` (`sep` between date and time); `always_fraction` keeps `.000000`.
fn push_ts(out: &mut Vec<u8>, us: i64, sep: u8, always_fraction: bool) {
    let secs = us.div_euclid(1_000_000);
    let frac = us.rem_euclid(1_000_000);
    let (y, m, d) = civil(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    push_num(out, y, 4);
    out.push(b'-');
    push_num(out, m as i64, 2);
    out.push(b'-');
    push_num(out, d as i64, 2);
    out.push(sep);
    push_num(out, sod / 3600, 2);
    out.push(b':');
    push_num(out, sod / 60 % 60, 2);
    out.push(b':');
    push_num(out, sod % 60, 2);
    if frac != 0 || always_fraction {
        out.push(b'.');
        push_num(out, frac, 6);
    }
}

/// A JSON string (pydantic escapes `"`, `\` and control characters; other text is kept as UTF-8).
pub fn json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b >= 0x20 && b != b'"' && b != b'\\' {
            continue;
        }
        out.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            _ => out.extend_from_slice(format!("\\u{:04x}", b).as_bytes()),
        }
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// A JSON number for a float, spelled as pydantic-core writes it: ryu's shortest round-trip digits
/// and layout (`0.00001`, `1.5e-7`, `1000000000000000.0`) with a `+` in a positive exponent (`1e+16`,
/// where ryu writes `1e16`); `null` for NaN and the infinities (pydantic's default
/// `ser_json_inf_nan`). The evidence payload is a json column, which keeps the spelling, so the
/// native and the Python engines must write the same text (`tests/unit/test_native_fold.py`).
pub fn json_f64(out: &mut Vec<u8>, v: f64) {
    if v.is_finite() {
        let mut buf = ryu::Buffer::new();
        let text = buf.format_finite(v).as_bytes();
        match text.iter().position(|&b| b == b'e') {
            Some(e) if text.get(e + 1) != Some(&b'-') => {
                out.extend_from_slice(&text[..=e]);
                out.push(b'+');
                out.extend_from_slice(&text[e + 1..]);
            }
            _ => out.extend_from_slice(text),
        }
    } else {
        out.extend_from_slice(b"null");
    }
}

/// `value` as JSON; false when it holds what this module does not write (bytes, maps).
pub fn json(out: &mut Vec<u8>, value: &Value) -> bool {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Int(i) => out.extend_from_slice(i.to_string().as_bytes()),
        Value::Double(f) => json_f64(out, *f),
        Value::Str(s) => json_str(out, s),
        Value::Ts(us) => {
            out.push(b'"');
            push_ts(out, *us, b'T', false);
            out.extend_from_slice(b"Z\"");
        }
        Value::Record(names, values) => {
            out.push(b'{');
            for (i, (n, v)) in names.iter().zip(values).enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                json_str(out, n);
                out.push(b':');
                if !json(out, v) {
                    return false;
                }
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                if !json(out, v) {
                    return false;
                }
            }
            out.push(b']');
        }
        Value::Bytes(_) | Value::Map(_) => return false,
    }
    true
}

// --- binary COPY (PostgreSQL documentation, "COPY", "Binary Format") ---------------------------

pub fn bin_null(out: &mut Vec<u8>) {
    out.extend_from_slice(&(-1i32).to_be_bytes());
}
pub fn bin_text(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as i32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}
pub fn bin_opt_text(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => bin_text(out, s),
        None => bin_null(out),
    }
}
pub fn bin_i32(out: &mut Vec<u8>, v: i32) {
    out.extend_from_slice(&4i32.to_be_bytes());
    out.extend_from_slice(&v.to_be_bytes());
}
pub fn bin_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&8i32.to_be_bytes());
    out.extend_from_slice(&v.to_be_bytes());
}
pub fn bin_ts(out: &mut Vec<u8>, us: i64) {
    bin_i64(out, us - PG_EPOCH_US);
}
pub fn bin_bool(out: &mut Vec<u8>, v: bool) {
    out.extend_from_slice(&1i32.to_be_bytes());
    out.push(v as u8);
}

// --- text COPY (what psycopg's text dumpers write) ------------------------------------------------

pub fn text_escaped(out: &mut Vec<u8>, s: &[u8]) {
    let mut start = 0;
    for (i, &b) in s.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'\\' => b"\\\\",
            b'\t' => b"\\t",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            0x08 => b"\\b",
            0x0b => b"\\v",
            0x0c => b"\\f",
            _ => continue,
        };
        out.extend_from_slice(&s[start..i]);
        out.extend_from_slice(escaped);
        start = i + 1;
    }
    out.extend_from_slice(&s[start..]);
}

pub fn text_f64(out: &mut Vec<u8>, v: f64) {
    if v.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if v.is_infinite() {
        out.extend_from_slice(if v > 0.0 { b"Infinity" } else { b"-Infinity" });
    } else {
        let mut buf = ryu::Buffer::new();
        out.extend_from_slice(buf.format_finite(v).as_bytes());
    }
}

pub fn text_ts(out: &mut Vec<u8>, us: i64) {
    push_ts(out, us, b' ', true);
    out.extend_from_slice(b"+00");
}
