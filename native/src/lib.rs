//! `tapeline_native`: the fresh replay's decode, fold and COPY encoding, compiled.
//!
//! A second implementation of `projections/projector.py` (`decode_batch`, `fold_batch`),
//! `domain/lifecycle.py` (`evolve`) and `projections/bulk.py` (`FoldState`); those Python rules are
//! the specification and `projections/native.py` drives this module. What it does not reproduce
//! exactly it does not guess: records it cannot decode, records of the dead-letter topic and
//! events holding a NUL character are handed back to Python one by one ("delegated"; the Python
//! rules make their dead letters), so is the dead letter of an event whose date arithmetic the
//! Python fold raises on, and anything else it cannot fold exactly (bytes or maps in a lifecycle
//! event) raises `Unsupported`, after which the caller replays with the Python engine.
//! The lifecycle data (states, final and reopenable sets, stage order, column lists, payload
//! omissions) is not restated here: build.rs generates it from schemas/lifecycle.json.
//! tests/unit/test_fold_differential.py folds generated lifecycles with both engines.

mod avro;
mod encode;
/// The lifecycle data (`STATES` and a `ST_*` per state, `FINAL`, `REOPENABLE`, `STAGE_ORDER`, `COLUMNS`
/// and a constant per column index, `EVIDENCE_COLUMNS`, `PAYLOAD_OMITS`, `BOOKKEEPING_EVENTS`, `SOURCE_JSON`), generated
/// by build.rs from schemas/lifecycle.json, the file the Python fold reads (`domain/lifecycle_data.py`).
#[allow(dead_code)]
mod lifecycle {
    include!(concat!(env!("OUT_DIR"), "/lifecycle.rs"));
}

use std::collections::{HashMap, HashSet};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use avro::{Plan, Reader, Schema, Value, TS_MAX, TS_MIN};
use encode::*;
use lifecycle::*;

/// FxHash (rustc's): the maps hold job ids and dedup keys this project's own processors wrote, so a
/// fast non-keyed hash is enough (SipHash was ~4 % of a replay's CPU).
#[derive(Default, Clone, Copy)]
struct Fx(u64);

impl Fx {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl std::hash::Hasher for Fx {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().unwrap()));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(b));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64)
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64)
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i)
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64)
    }
    fn finish(&self) -> u64 {
        // A product's high bits depend on every input bit, its low ones only on the input's low
        // bits; hashbrown indexes buckets by the low bits: rotate the well-mixed ones down (as
        // rustc-hash 2 does). Without it the dedup-key pairs (job << 32 | rest) all collided.
        self.0.rotate_left(26)
    }
}

type FxBuild = std::hash::BuildHasherDefault<Fx>;
type FxMap<K, V> = HashMap<K, V, FxBuild>;
type FxSet<K> = HashSet<K, FxBuild>;

create_exception!(tapeline_native, Unsupported, PyException, "The native engine cannot fold this log exactly.");

#[derive(Clone, Debug, PartialEq)]
enum Cell {
    N,
    S(String),
    I(i64),
    F(f64),
    T(i64),
    B(bool),
    J(String),
}

impl Cell {
    fn s(&self) -> Option<&str> {
        match self {
            Cell::S(s) => Some(s),
            _ => None,
        }
    }
    /// Python's `row.get(c) or 0` for an int column.
    fn i_or0(&self) -> i64 {
        match self {
            Cell::I(i) => *i,
            _ => 0,
        }
    }
}

fn opt_s(v: Option<&str>) -> Cell {
    v.map_or(Cell::N, |s| Cell::S(s.to_string()))
}

type Row = Vec<Cell>;

enum Slot {
    Open(Box<Row>),
    /// A job written in a final state: only its state stays (`bulk._FINAL_STUBS`).
    Done(&'static str),
}

fn final_name(state: &str) -> Option<&'static str> {
    FINAL.iter().copied().find(|s| *s == state)
}

/// `fold.STAGE_ORDER.get(stage, 0)`.
fn stage_order(stage: Option<&str>) -> i64 {
    stage.and_then(|s| STAGE_ORDER.iter().position(|x| *x == s)).map_or(0, |i| i as i64)
}

/// The names of a `pipeline_stages` cell (a JSON array of stage names, as `json` writes it; stage
/// names are plain identifiers, so no escapes); empty for null.
fn stage_names(cell: &Cell) -> Vec<&str> {
    match cell {
        Cell::J(text) => text.trim().trim_start_matches('[').trim_end_matches(']').split(',')
            .map(|p| p.trim().trim_matches('"')).filter(|p| !p.is_empty()).collect(),
        _ => Vec::new(),
    }
}

/// `pipeline.stage_position(stage, row["pipeline_stages"])`: 1 + the stage's index in the job's
/// recorded stages, else `stage_order` (jobs accepted before profiles, and intake).
fn stage_position(stage: Option<&str>, stages: &Cell) -> i64 {
    if let Some(s) = stage {
        if let Some(i) = stage_names(stages).iter().position(|x| *x == s) {
            return i as i64 + 1;
        }
    }
    stage_order(stage)
}

/// `(a or []) + b` for two JSON array cells (`a` may be null).
fn json_concat(a: &Cell, b: Cell) -> Cell {
    let inner = |c: &Cell| match c {
        Cell::J(t) => t.trim().trim_start_matches('[').trim_end_matches(']').trim().to_string(),
        _ => String::new(),
    };
    let parts: Vec<String> = [inner(a), inner(&b)].into_iter().filter(|p| !p.is_empty()).collect();
    Cell::J(format!("[{}]", parts.join(",")))
}

/// `timedelta(seconds=s)` in microseconds, rounded as CPython rounds it; None where Python raises.
fn timedelta_us(s: f64) -> Option<i64> {
    if !s.is_finite() || s.abs() > 1e15 {
        return None;
    }
    let whole = s.trunc();
    let t = (s - whole) * 1e6;
    let ip = t.trunc();
    let left = t - ip;
    let base = whole as i64 * 1_000_000 + ip as i64;
    let mut r = left.round();
    if (r - left).abs() == 0.5 {
        let odd = (base & 1) as f64;
        r = 2.0 * ((left + odd) * 0.5).round() - odd;
    }
    Some(base + r as i64)
}

/// `broker_ts + delta`, None where datetime overflows.
fn add_us(ts: i64, delta: i64) -> Option<i64> {
    ts.checked_add(delta).filter(|v| (TS_MIN..=TS_MAX).contains(v))
}

/// Python's `f"{x:.1f}"`.
fn fmt_1f(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf".into() } else { "-inf".into() }
    } else {
        format!("{x:.1}")
    }
}

struct TypeInfo {
    name: String,
    index: FxMap<String, usize>,
    names: Vec<String>,
    in_payload: Vec<bool>,
}

struct Ev<'a> {
    t: &'a TypeInfo,
    v: &'a [Value],
}

impl<'a> Ev<'a> {
    fn val(&self, name: &str) -> &'a Value {
        match self.t.index.get(name) {
            Some(&i) => &self.v[i],
            None => &Value::Null,
        }
    }
    fn s(&self, name: &str) -> Option<&'a str> {
        match self.val(name) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    fn str(&self, name: &str) -> &'a str {
        self.s(name).unwrap_or("")
    }
    fn i(&self, name: &str) -> Option<i64> {
        match self.val(name) {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
    fn f(&self, name: &str) -> Option<f64> {
        match self.val(name) {
            Value::Double(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    fn ts(&self, name: &str) -> Option<i64> {
        match self.val(name) {
            Value::Ts(t) => Some(*t),
            _ => None,
        }
    }
    fn json_cell(&self, name: &str) -> Result<Cell, String> {
        let mut out = Vec::new();
        if !json(&mut out, self.val(name)) {
            return Err(format!("{name} holds bytes or a map"));
        }
        Ok(Cell::J(String::from_utf8(out).unwrap()))
    }
}

fn holds_bytes_or_map(v: &Value) -> bool {
    match v {
        Value::Bytes(_) | Value::Map(_) => true,
        Value::Record(_, vs) | Value::Array(vs) => vs.iter().any(holds_bytes_or_map),
        _ => false,
    }
}

/// The set of applied dedup keys, interned like `bulk.KeySet`: `{head}:{rest}` as a pair of ids.
#[derive(Default)]
struct KeySet {
    heads: FxMap<String, u32>,
    head_names: Vec<String>,
    rests: FxMap<String, u32>,
    rest_names: Vec<String>,
    pairs: FxSet<u64>,
    plain: FxSet<String>,
}

impl KeySet {
    fn contains(&self, key: &str) -> bool {
        match key.split_once(':') {
            None => self.plain.contains(key),
            Some((h, r)) => match (self.heads.get(h), self.rests.get(r)) {
                (Some(&h), Some(&r)) => self.pairs.contains(&(((h as u64) << 32) | r as u64)),
                _ => false,
            },
        }
    }
    fn add(&mut self, key: &str) {
        match key.split_once(':') {
            None => {
                self.plain.insert(key.to_string());
            }
            Some((h, r)) => {
                let hid = intern(&mut self.heads, &mut self.head_names, h);
                let rid = intern(&mut self.rests, &mut self.rest_names, r);
                self.pairs.insert(((hid as u64) << 32) | rid as u64);
            }
        }
    }
    fn len(&self) -> usize {
        self.plain.len() + self.pairs.len()
    }
}

fn intern(map: &mut FxMap<String, u32>, names: &mut Vec<String>, s: &str) -> u32 {
    if let Some(&id) = map.get(s) {
        return id;
    }
    let id = names.len() as u32;
    names.push(s.to_string());
    map.insert(s.to_string(), id);
    id
}

struct Upload {
    values: (String, String, String, i64, String, String, i64, String),
    copies: i64,
}

/// Outcome of one evolve: (applied, superseded); the row was changed in place when applied.
type Outcome = (bool, bool);

/// Why `evolve` did not fold an event.
enum EvolveError {
    /// Date arithmetic `fold.evolve` raises on (a NaN or huge lease, a date past year 9999): the
    /// Python side makes the dead letter (it words the error as Python does); the lease read, if any.
    Range(Option<f64>),
    /// Something this engine does not fold: the replay falls back to the Python engine.
    Other(String),
}

impl From<&str> for EvolveError {
    fn from(s: &str) -> Self {
        EvolveError::Other(s.to_string())
    }
}

impl From<String> for EvolveError {
    fn from(s: String) -> Self {
        EvolveError::Other(s)
    }
}

#[pyclass(unsendable)]
struct Engine {
    writers: FxMap<[u8; 8], (usize, Plan)>,
    types: std::rc::Rc<Vec<TypeInfo>>,
    clock_topic: Option<String>,
    dlq_topic: Option<String>,
    rows: FxMap<String, Slot>,
    keys: KeySet,
    uploads: FxMap<String, Upload>,
    clock: FxMap<i32, i64>,
    pending_final: Vec<String>,
    job_ids: FxSet<String>,
}

enum Dead {
    Delegate(usize),
    EvolveError(usize, Option<f64>),
    Job(Vec<PyObject>),
    Replay(Vec<PyObject>),
}

#[pymethods]
impl Engine {
    /// `readers`: {event type: current schema (dict)}; `writers`: [(fingerprint, event type, writer
    /// schema)] for every writer the Python codec reads; `columns`: `fold.JOB_STATE_COLUMNS`
    /// (checked against this module's); `omits`: `writes.PAYLOAD_OMITS` (checked too).
    #[new]
    #[pyo3(signature = (readers, writers, columns, omits, clock_topic=None, dlq_topic=None))]
    fn new(
        py: Python<'_>,
        readers: &Bound<'_, PyDict>,
        writers: Vec<(Vec<u8>, String, Bound<'_, PyAny>)>,
        columns: Vec<String>,
        omits: Vec<String>,
        clock_topic: Option<String>,
        dlq_topic: Option<String>,
    ) -> PyResult<Self> {
        if columns != COLUMNS {
            return Err(Unsupported::new_err(
                "job_state columns differ from the native engine's: it was built from another schemas/lifecycle.json \
                 (rebuild it: scripts/bootstrap.sh)",
            ));
        }
        let mut want: Vec<&str> = PAYLOAD_OMITS.to_vec();
        want.sort();
        let mut got: Vec<&str> = omits.iter().map(|s| s.as_str()).collect();
        got.sort();
        if want != got {
            return Err(Unsupported::new_err(
                "writes.PAYLOAD_OMITS differs from the native engine's: it was built from another \
                 schemas/lifecycle.json (rebuild it: scripts/bootstrap.sh)",
            ));
        }
        let mut types = Vec::new();
        let mut reader_schemas: HashMap<String, (usize, Schema)> = HashMap::new();
        for (name, schema) in readers.iter() {
            let name: String = name.extract()?;
            let parsed = avro::parse(&schema, &mut HashMap::new()).map_err(|e| Unsupported::new_err(format!("{name}: {e}")))?;
            let Schema::Record(rec) = &parsed else {
                return Err(Unsupported::new_err(format!("{name}: not a record")));
            };
            let names: Vec<String> = rec.fields.iter().map(|f| f.name.clone()).collect();
            let index = names.iter().enumerate().map(|(i, n)| (n.clone(), i)).collect();
            let in_payload = names.iter().map(|n| !PAYLOAD_OMITS.contains(&n.as_str())).collect();
            reader_schemas.insert(name.clone(), (types.len(), parsed.clone()));
            types.push(TypeInfo { name, index, names, in_payload });
        }
        let mut plans = FxMap::default();
        for (fp, name, schema) in writers {
            let fp: [u8; 8] = fp.try_into().map_err(|_| Unsupported::new_err("fingerprint is not 8 bytes"))?;
            let Some((t, reader)) = reader_schemas.get(&name) else { continue };
            let writer = avro::parse(&schema, &mut HashMap::new()).map_err(|e| Unsupported::new_err(format!("{name} writer: {e}")))?;
            let plan = avro::resolve(py, &writer, reader).map_err(|e| Unsupported::new_err(format!("{name} writer: {e}")))?;
            plans.insert(fp, (*t, plan));
        }
        Ok(Engine {
            writers: plans,
            types: std::rc::Rc::new(types),
            clock_topic,
            dlq_topic,
            rows: FxMap::default(),
            keys: KeySet::default(),
            uploads: FxMap::default(),
            clock: FxMap::default(),
            pending_final: Vec::new(),
            job_ids: FxSet::default(),
        })
    }

    /// Decode and fold `messages` (confluent_kafka Messages, in consumption order). Returns
    /// (evidence rows in binary COPY format without header, [(topic, partition, next offset)],
    /// (applied, duplicates, superseded), dead: [("delegate", index) | ("job", ...) | ("replay", ...)]
    /// in log order). Raises `Unsupported` (state then undefined: replay with the Python engine).
    fn fold<'py>(&mut self, py: Python<'py>, messages: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyTuple>> {
        let mut out: Vec<u8> = Vec::with_capacity(messages.len() * 400);
        let mut positions: Vec<(String, i32, i64)> = Vec::new();
        let (mut applied_n, mut dup_n, mut sup_n) = (0i64, 0i64, 0i64);
        let mut dead: Vec<Dead> = Vec::new();
        let (m_topic, m_part, m_off, m_ts, m_val) = (
            pyo3::intern!(py, "topic"),
            pyo3::intern!(py, "partition"),
            pyo3::intern!(py, "offset"),
            pyo3::intern!(py, "timestamp"),
            pyo3::intern!(py, "value"),
        );
        let mut payload: Vec<u8> = Vec::with_capacity(1024);
        let mut last_topic: Option<Bound<'py, PyAny>> = None;
        let mut topic_s = String::new();
        let types = self.types.clone();
        for (index, message) in messages.iter().enumerate() {
            let topic_obj = message.call_method0(m_topic)?;
            if last_topic.as_ref().map_or(true, |t| !t.is(&topic_obj)) {
                topic_s = topic_obj.downcast::<PyString>()?.to_str()?.to_string();
                last_topic = Some(topic_obj);
            }
            let topic = topic_s.as_str();
            let partition: i32 = message.call_method0(m_part)?.extract()?;
            let offset: i64 = message.call_method0(m_off)?.extract()?;
            let (_, millis): (i64, i64) = message.call_method0(m_ts)?.extract()?;
            let ts = millis.checked_mul(1000).filter(|v| (TS_MIN..=TS_MAX).contains(v))
                .ok_or_else(|| Unsupported::new_err("broker timestamp out of datetime's range"))?;
            match positions.iter_mut().find(|(t, p, _)| t == topic && *p == partition) {
                Some(pos) => pos.2 = offset + 1,
                None => positions.push((topic.to_string(), partition, offset + 1)),
            }
            if self.clock_topic.as_deref() == Some(topic) {
                let now = self.clock.entry(partition).or_insert(ts);
                if ts > *now {
                    *now = ts;
                }
            }
            let value = message.call_method0(m_val)?;
            let decoded = match value.downcast::<PyBytes>() {
                Ok(b) => self.decode(b.as_bytes()),
                Err(_) => None,
            };
            let Some((t, fields, nul)) = decoded else {
                dead.push(Dead::Delegate(index));
                continue;
            };
            let ev = Ev { t: &types[t], v: &fields };
            let kind = ev.t.name.as_str();
            if kind == "WatchdogTick" {
                continue;
            }
            if self.dlq_topic.as_deref() == Some(topic) || nul {
                dead.push(Dead::Delegate(index));
                continue;
            }
            if fields.iter().any(holds_bytes_or_map) {
                return Err(Unsupported::new_err(format!("{kind} holds bytes or a map outside the dead-letter topic")));
            }
            if kind == "UploadCompleted" {
                let upload_id = ev.str("upload_id");
                match self.uploads.get_mut(upload_id) {
                    Some(u) => u.copies += 1,
                    None => {
                        let values = (
                            upload_id.to_string(),
                            ev.str("job_id").to_string(),
                            ev.str("filename").to_string(),
                            ev.i("size_bytes").unwrap_or(0),
                            ev.str("sha256").to_string(),
                            ev.str("priority").to_string(),
                            ts,
                            ev.str("submitter").to_string(),
                        );
                        self.uploads.insert(upload_id.to_string(), Upload { values, copies: 1 });
                    }
                }
                continue;
            }
            let job_id = ev.str("job_id");
            let dedup_key = ev.str("dedup_key");
            let attempt = ev.i("attempt").unwrap_or(0);
            let attempt32 = i32::try_from(attempt).map_err(|_| Unsupported::new_err("attempt out of int4 range"))?;
            let duplicate = self.keys.contains(dedup_key);
            let (mut applied, mut superseded) = (false, false);
            if !duplicate {
                (applied, superseded) = match self.evolve(&ev, ts) {
                    Ok(outcome) => outcome,
                    Err(EvolveError::Range(lease)) => {
                        dead.push(Dead::EvolveError(index, lease));
                        (false, false) // kept as evidence, not applied
                    }
                    Err(EvolveError::Other(e)) => {
                        return Err(Unsupported::new_err(format!("{kind} at {topic}/{partition}/{offset}: {e}")))
                    }
                };
                if applied {
                    if let Some(Slot::Open(row)) = self.rows.get_mut(job_id) {
                        row[LOG_PARTITION] = Cell::I(partition as i64);
                        if let Some(name) = row[STATE].s().and_then(final_name) {
                            let _ = name;
                            self.pending_final.push(job_id.to_string());
                        }
                    }
                    self.keys.add(dedup_key);
                    if kind == "JobDeadLettered" {
                        let recorded_by = ev.str("recorded_by");
                        let processor = recorded_by.split('@').next().unwrap_or("");
                        dead.push(Dead::Job(vec![
                            format!("{job_id}/{attempt}").into_pyobject(py)?.into_any().unbind(),
                            topic.into_pyobject(py)?.into_any().unbind(),
                            partition.into_pyobject(py)?.into_any().unbind(),
                            offset.into_pyobject(py)?.into_any().unbind(),
                            ts.into_pyobject(py)?.into_any().unbind(),
                            ev.s("reason").into_pyobject(py)?.into_any().unbind(),
                            processor.into_pyobject(py)?.into_any().unbind(),
                            ev.s("error_class").into_pyobject(py)?.into_any().unbind(),
                            job_id.into_pyobject(py)?.into_any().unbind(),
                            ev.s("stage").into_pyobject(py)?.into_any().unbind(),
                            attempt.into_pyobject(py)?.into_any().unbind(),
                            ev.i("attempts").into_pyobject(py)?.into_any().unbind(),
                            ev.s("evidence").into_pyobject(py)?.into_any().unbind(),
                        ]));
                    } else if kind == "JobReplayed" {
                        if let Some(id) = ev.s("dead_letter_id").filter(|s| !s.is_empty()) {
                            dead.push(Dead::Replay(vec![
                                id.into_pyobject(py)?.into_any().unbind(),
                                ts.into_pyobject(py)?.into_any().unbind(),
                                ev.s("operator").into_pyobject(py)?.into_any().unbind(),
                                ev.s("reason").into_pyobject(py)?.into_any().unbind(),
                            ]));
                        }
                    }
                }
            }
            applied_n += applied as i64;
            dup_n += duplicate as i64;
            sup_n += superseded as i64;
            if !self.job_ids.contains(job_id) {
                self.job_ids.insert(job_id.to_string());
            }
            // The evidence row (writes.EVIDENCE_COLUMNS, writes.EVIDENCE_TYPES), binary COPY.
            payload.clear();
            payload.push(b'{');
            let mut first = true;
            for (i, name) in ev.t.names.iter().enumerate() {
                if !ev.t.in_payload[i] {
                    continue;
                }
                if !first {
                    payload.push(b',');
                }
                first = false;
                json_str(&mut payload, name);
                payload.push(b':');
                json(&mut payload, &fields[i]);
            }
            payload.push(b'}');
            out.extend_from_slice(&(EVIDENCE_COLUMNS.len() as i16).to_be_bytes());
            bin_text(&mut out, topic);
            bin_i32(&mut out, partition);
            bin_i64(&mut out, offset);
            bin_ts(&mut out, ts);
            bin_text(&mut out, ev.str("event_id"));
            bin_text(&mut out, kind);
            bin_text(&mut out, job_id);
            bin_text(&mut out, ev.str("stage"));
            bin_i32(&mut out, attempt32);
            bin_opt_text(&mut out, ev.s("claim_token"));
            bin_text(&mut out, dedup_key);
            bin_ts(&mut out, ev.ts("occurred_at").unwrap_or(0));
            bin_text(&mut out, ev.str("recorded_by"));
            bin_opt_text(&mut out, ev.s("causation_id"));
            bin_bool(&mut out, applied);
            bin_bool(&mut out, superseded);
            bin_bool(&mut out, duplicate);
            out.extend_from_slice(&(payload.len() as i32).to_be_bytes());
            out.extend_from_slice(&payload);
        }
        let dead_list = PyList::empty(py);
        for d in dead {
            let item = match d {
                Dead::Delegate(i) => PyTuple::new(py, [
                    "delegate".into_pyobject(py)?.into_any(),
                    i.into_pyobject(py)?.into_any(),
                ])?,
                Dead::EvolveError(i, lease) => PyTuple::new(py, [
                    "evolve_error".into_pyobject(py)?.into_any(),
                    (i, lease).into_pyobject(py)?.into_any(),
                ])?,
                Dead::Job(v) => PyTuple::new(py, [
                    "job".into_pyobject(py)?.into_any(),
                    PyTuple::new(py, v)?.into_any(),
                ])?,
                Dead::Replay(v) => PyTuple::new(py, [
                    "replay".into_pyobject(py)?.into_any(),
                    PyTuple::new(py, v)?.into_any(),
                ])?,
            };
            dead_list.append(item)?;
        }
        PyTuple::new(py, [
            PyBytes::new(py, &out).into_any(),
            positions.into_pyobject(py)?.into_any(),
            (applied_n, dup_n, sup_n).into_pyobject(py)?.into_any(),
            dead_list.into_any(),
        ])
    }

    /// Final job rows queued since the last call.
    fn pending_final(&self) -> usize {
        self.pending_final.len()
    }

    /// The queued final jobs' rows in text COPY format (`fold.JOB_STATE_COLUMNS`); they become stubs.
    fn take_final_rows<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let mut out = Vec::new();
        for job_id in std::mem::take(&mut self.pending_final) {
            if let Some(slot) = self.rows.get_mut(&job_id) {
                if let Slot::Open(row) = slot {
                    text_row(&mut out, row);
                    let state = row[STATE].s().and_then(final_name).unwrap_or(ST_COMPLETED);
                    *slot = Slot::Done(state);
                }
            }
        }
        PyBytes::new(py, &out)
    }

    /// Rows of the jobs not written yet, text COPY format, in chunks of about `chunk_bytes`.
    fn open_rows<'py>(&self, py: Python<'py>, chunk_bytes: usize) -> Vec<Bound<'py, PyBytes>> {
        let mut chunks = Vec::new();
        let mut out = Vec::new();
        for slot in self.rows.values() {
            if let Slot::Open(row) = slot {
                text_row(&mut out, row);
                if out.len() >= chunk_bytes {
                    chunks.push(PyBytes::new(py, &out));
                    out.clear();
                }
            }
        }
        if !out.is_empty() {
            chunks.push(PyBytes::new(py, &out));
        }
        chunks
    }

    /// Every applied dedup key, text COPY format (one column), in chunks of about `chunk_bytes`.
    fn keys<'py>(&self, py: Python<'py>, chunk_bytes: usize) -> Vec<Bound<'py, PyBytes>> {
        let mut chunks = Vec::new();
        let mut out = Vec::new();
        let mut flush = |out: &mut Vec<u8>, chunks: &mut Vec<Bound<'py, PyBytes>>, force: bool| {
            if (force && !out.is_empty()) || out.len() >= chunk_bytes {
                chunks.push(PyBytes::new(py, out));
                out.clear();
            }
        };
        for k in &self.keys.plain {
            text_escaped(&mut out, k.as_bytes());
            out.push(b'\n');
            flush(&mut out, &mut chunks, false);
        }
        for pair in &self.keys.pairs {
            let (h, r) = ((pair >> 32) as usize, (pair & 0xffff_ffff) as usize);
            text_escaped(&mut out, self.keys.head_names[h].as_bytes());
            out.push(b':');
            text_escaped(&mut out, self.keys.rest_names[r].as_bytes());
            out.push(b'\n');
            flush(&mut out, &mut chunks, false);
        }
        flush(&mut out, &mut chunks, true);
        chunks
    }

    fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// Uploads: [(upload_id, job_id, filename, size_bytes, sha256, priority, broker_ts_us, submitter, copies)].
    fn uploads(&self) -> Vec<(String, String, String, i64, String, String, i64, String, i64)> {
        self.uploads
            .values()
            .map(|u| {
                let v = u.values.clone();
                (v.0, v.1, v.2, v.3, v.4, v.5, v.6, v.7, u.copies)
            })
            .collect()
    }

    /// The log clock: [(partition, broker_ts_us)].
    fn clock(&self) -> Vec<(i32, i64)> {
        self.clock.iter().map(|(p, t)| (*p, *t)).collect()
    }

    /// Job ids of every evidence row folded.
    fn job_ids(&self) -> Vec<String> {
        self.job_ids.iter().cloned().collect()
    }
}

fn text_row(out: &mut Vec<u8>, row: &Row) {
    for (i, cell) in row.iter().enumerate() {
        if i > 0 {
            out.push(b'\t');
        }
        match cell {
            Cell::N => out.extend_from_slice(b"\\N"),
            Cell::S(s) | Cell::J(s) => text_escaped(out, s.as_bytes()),
            Cell::I(v) => out.extend_from_slice(v.to_string().as_bytes()),
            Cell::F(v) => text_f64(out, *v),
            Cell::T(v) => text_ts(out, *v),
            Cell::B(v) => out.push(if *v { b't' } else { b'f' }),
        }
    }
    out.push(b'\n');
}

impl Engine {
    /// The event of a single-object-encoded record, or None for anything `codec.decode` might
    /// refuse (the caller delegates it to Python, which says why).
    fn decode(&self, data: &[u8]) -> Option<(usize, Vec<Value>, bool)> {
        if data.len() < 10 || data[..2] != [0xc3, 0x01] {
            return None;
        }
        let fp: [u8; 8] = data[2..10].try_into().ok()?;
        let (t, plan) = self.writers.get(&fp)?;
        let mut reader = Reader { buf: &data[10..], pos: 0, nul: false };
        let value = reader.read(plan).ok()?;
        if reader.pos != reader.buf.len() {
            return None;
        }
        let Value::Record(_, fields) = value else { return None };
        let info = &self.types[*t];
        match fields.get(*info.index.get("event_type")?) {
            Some(Value::Str(s)) if *s == info.name => {}
            _ => return None,
        }
        Some((*t, fields, reader.nul))
    }

    /// `fold.evolve`, on the row in `self.rows` (changed in place, created for an intake decision).
    fn evolve(&mut self, ev: &Ev, ts: i64) -> Result<Outcome, EvolveError> {
        let kind = ev.t.name.as_str();
        let job_id = ev.str("job_id");
        let slot = self.rows.get_mut(job_id);
        let row: &mut Row = match slot {
            None => {
                let mut row: Row = vec![Cell::N; COLUMNS.len()];
                let new = |row: &mut Row| {
                    row[JOB_ID] = Cell::S(job_id.to_string());
                    row[ATTEMPT] = Cell::I(0);
                    row[ATTEMPTS] = Cell::I(0);
                    row[EVENTS] = Cell::I(1);
                    row[LAST_EVENT_TYPE] = Cell::S(kind.to_string());
                    row[CREATED_AT] = Cell::T(ts);
                    row[UPDATED_AT] = Cell::T(ts);
                    row[YIELDS] = Cell::I(0);
                    row[REDRIVES] = Cell::I(0);
                    row[BUDGET_BASE] = Cell::I(0);
                    row[UPLOAD_ID] = opt_s(ev.s("upload_id"));
                    row[STAGE] = Cell::S("intake".into());
                };
                if kind == "JobAccepted" {
                    new(&mut row);
                    row[STATE] = Cell::S(ST_ACCEPTED.into());
                    row[PRIORITY] = opt_s(ev.s("priority"));
                    row[PROFILE] = opt_s(ev.s("profile"));
                    row[SOURCE_KEY] = opt_s(ev.s("source_key"));
                    row[SOURCE_SHA256] = opt_s(ev.s("source_sha256"));
                    row[SOURCE_SIZE_BYTES] = ev.i("source_size_bytes").map_or(Cell::N, Cell::I);
                    let Value::Record(names, media) = ev.val("media") else {
                        return Err("JobAccepted without media".into());
                    };
                    let get = |n: &str| names.iter().position(|x| x == n).map(|i| &media[i]);
                    row[SOURCE_DURATION_S] = match get("duration_s") {
                        Some(Value::Double(f)) => Cell::F(*f),
                        Some(Value::Int(i)) => Cell::F(*i as f64),
                        _ => return Err("media.duration_s missing".into()),
                    };
                    row[SOURCE_WIDTH] = match get("display_width") {
                        Some(Value::Int(i)) => Cell::I(*i),
                        _ => return Err("media.display_width missing".into()),
                    };
                    row[SOURCE_HEIGHT] = match get("display_height") {
                        Some(Value::Int(i)) => Cell::I(*i),
                        _ => return Err("media.display_height missing".into()),
                    };
                    row[LADDER] = ev.json_cell("ladder")?;
                    row[PROFILE_FINGERPRINT] = opt_s(ev.s("profile_fingerprint"));
                    row[DEGRADED] = match ev.val("degraded") {
                        Value::Bool(b) => Cell::B(*b),
                        _ => Cell::N,
                    };
                    row[DEGRADED_REASON] = opt_s(ev.s("degraded_reason"));
                    row[X264_PRESET] = opt_s(ev.s("x264_preset"));
                    row[PIPELINE] = opt_s(ev.s("pipeline"));
                    row[PIPELINE_STAGES] = match ev.val("pipeline_stages") {
                        Value::Array(a) if !a.is_empty() => ev.json_cell("pipeline_stages")?,
                        _ => Cell::N,
                    };
                } else if kind == "JobRejected" {
                    new(&mut row);
                    row[STATE] = Cell::S(ST_REJECTED.into());
                    row[ERROR_CLASS] = opt_s(ev.s("error_class"));
                    row[REASON] = opt_s(ev.s("reason"));
                    row[COMPLETED_AT] = Cell::T(ts);
                } else {
                    return Ok((false, false)); // an event of an unknown job: evidence only
                }
                self.rows.insert(job_id.to_string(), Slot::Open(Box::new(row)));
                return Ok((true, false));
            }
            Some(Slot::Done(_)) => return Ok((false, false)),
            Some(Slot::Open(row)) => row,
        };
        let state = row[STATE].s().unwrap_or("");
        if FINAL.contains(&state) {
            return Ok((false, false));
        }
        let reopenable = REOPENABLE.contains(&state);
        if reopenable && kind != "JobReplayed" {
            return Ok((false, false));
        }
        if kind != "AttemptStarted" {
            if let Some(token) = ev.s("claim_token") {
                if Some(token) != row[CLAIM_TOKEN].s() {
                    return Ok((false, true));
                }
            }
        }
        // An ending event without the running attempt's claim (as `lifecycle._ends_without_claim`).
        if state == "running" && ev.s("claim_token").is_none() {
            if let Some((_, without)) = ENDING_WITHOUT_CLAIM.iter().find(|e| e.0 == kind) {
                let ends = *without == "always"
                    || (*without == "after_stall" && row[LAST_EVENT_TYPE].s() == Some("StallDetected"));
                if !ends {
                    return Ok((false, true));
                }
            }
        }
        let ev_pos = (stage_position(ev.s("stage"), &row[PIPELINE_STAGES]), ev.i("attempt").unwrap_or(0));
        let row_pos = (stage_position(row[STAGE].s(), &row[PIPELINE_STAGES]), row[ATTEMPT].i_or0());
        if kind == "AttemptStarted" && ev_pos < row_pos {
            return Ok((false, true));
        }
        if kind == "StageQueued" && !(ev_pos > row_pos) {
            return Ok((false, true));
        }
        if (kind == "StallDetected" || kind == "RetryScheduled")
            && (ev.s("stage") != row[STAGE].s() || Some(row[ATTEMPT].i_or0()) != ev.i("attempt")
                || !matches!(row[ATTEMPT], Cell::I(_)))
        {
            return Ok((false, true));
        }
        if kind == "JobReplayed" && !reopenable {
            return Ok((false, false));
        }
        if kind == "JobAccepted" || kind == "JobRejected" {
            return Ok((false, false));
        }
        // What can fail (as Python raises), before anything changes.
        let lease_until = match kind {
            "AttemptStarted" => {
                let lease = ev.f("lease_s").ok_or("lease_s missing")?;
                Some(timedelta_us(lease).and_then(|d| add_us(ts, d)).ok_or(EvolveError::Range(None))?)
            }
            "Heartbeat" => {
                let lease = match row[LEASE_S] {
                    Cell::F(f) if f != 0.0 => f,
                    _ => 0.0,
                };
                Some(timedelta_us(lease).and_then(|d| add_us(ts, d)).ok_or(EvolveError::Range(Some(lease)))?)
            }
            _ => None,
        };
        let retry_due = if kind == "RetryScheduled" {
            let (nb, oc) = (ev.ts("not_before").ok_or("not_before missing")?, ev.ts("occurred_at").ok_or("occurred_at missing")?);
            Some(add_us(ts, (nb - oc).max(0)).ok_or(EvolveError::Range(None))?)
        } else {
            None
        };
        let events = row[EVENTS].i_or0();
        row[EVENTS] = Cell::I(events + 1);
        row[LAST_EVENT_TYPE] = Cell::S(kind.to_string());
        row[UPDATED_AT] = Cell::T(ts);
        let s = |name: &str| opt_s(ev.s(name));
        match kind {
            "StageQueued" => {
                row[STATE] = Cell::S(ST_QUEUED.into());
                row[STAGE] = s("stage");
                row[ATTEMPT] = ev.i("attempt").map_or(Cell::N, Cell::I);
                for c in [CLAIM_TOKEN, WORKER, LEASED_UNTIL, PROGRESS_FRAMES, PROGRESS_OUT_TIME_S, PROGRESS_SPEED,
                          PROGRESS_AT, RETRY_NEXT_ATTEMPT, RETRY_DUE_AT, PROGRESS_GRACE_S] {
                    row[c] = Cell::N;
                }
                row[QUEUED_AT] = Cell::T(ts);
                row[REDRIVES] = Cell::I(0);
            }
            "AttemptStarted" => {
                let attempt = ev.i("attempt").unwrap_or(0);
                row[STATE] = Cell::S(ST_RUNNING.into());
                row[STAGE] = s("stage");
                row[ATTEMPT] = Cell::I(attempt);
                row[CLAIM_TOKEN] = s("claim_token");
                row[WORKER] = s("worker");
                row[LEASE_S] = ev.f("lease_s").map_or(Cell::N, Cell::F);
                row[LEASED_UNTIL] = Cell::T(lease_until.unwrap());
                row[ATTEMPTS] = Cell::I(row[ATTEMPTS].i_or0().max(attempt));
                row[PROGRESS_FRAMES] = Cell::I(0);
                row[PROGRESS_OUT_TIME_S] = Cell::F(0.0);
                row[PROGRESS_SPEED] = Cell::N;
                row[PROGRESS_AT] = Cell::T(ts);
                row[LAST_HEARTBEAT_AT] = Cell::T(ts);
                row[PROGRESS_GRACE_S] = Cell::N;
            }
            "Heartbeat" => {
                let frames = ev.i("frames_done").unwrap_or(0);
                let out_time = ev.f("out_time_s").unwrap_or(0.0);
                let row_out = match row[PROGRESS_OUT_TIME_S] {
                    Cell::F(f) if f != 0.0 => f,
                    _ => 0.0,
                };
                let advanced = frames > row[PROGRESS_FRAMES].i_or0() || out_time > row_out;
                row[LEASED_UNTIL] = Cell::T(lease_until.unwrap());
                row[LAST_HEARTBEAT_AT] = Cell::T(ts);
                row[PROGRESS_FRAMES] = Cell::I(frames);
                row[PROGRESS_OUT_TIME_S] = Cell::F(out_time);
                row[PROGRESS_SPEED] = ev.f("speed").map_or(Cell::N, Cell::F);
                if advanced {
                    row[PROGRESS_AT] = Cell::T(ts);
                }
                match ev.f("progress_grace_s") {
                    Some(g) if g != 0.0 => row[PROGRESS_GRACE_S] = Cell::F(g), // NaN is truthy too
                    _ if advanced => row[PROGRESS_GRACE_S] = Cell::N,
                    _ => {}
                }
            }
            "AttemptSucceeded" => {
                if !stage_names(&row[PIPELINE_STAGES]).is_empty() {
                    // `lifecycle.evolve`: every stage but the last adds its outputs to the job's; one
                    // that made renditions sets the ladder.
                    let stages = stage_names(&row[PIPELINE_STAGES]);
                    let stage = ev.s("stage");
                    let hands_on = stage.is_some_and(|s| stages.contains(&s) && stages.last() != Some(&s));
                    if hands_on {
                        let outputs = ev.json_cell("outputs")?;
                        row[OUTPUTS] = json_concat(&row[OUTPUTS], outputs);
                        if matches!(ev.val("renditions"), Value::Array(r) if !r.is_empty()) {
                            row[LADDER] = ev.json_cell("renditions")?;
                            row[AUDIO_PLAYLIST_KEY] = s("audio_playlist_key");
                        }
                    }
                } else if ev.s("stage") == Some("transcode") {
                    row[OUTPUTS] = ev.json_cell("outputs")?;
                    row[LADDER] = ev.json_cell("renditions")?;
                    row[AUDIO_PLAYLIST_KEY] = s("audio_playlist_key");
                }
                row[LEASED_UNTIL] = Cell::N;
            }
            "AttemptFailed" => {
                row[ERROR_CLASS] = s("error_class");
                row[REASON] = s("reason");
                row[LEASED_UNTIL] = Cell::N;
            }
            "AttemptYielded" => {
                row[LEASED_UNTIL] = Cell::N;
                row[REASON] = s("reason");
                row[YIELDS] = Cell::I(row[YIELDS].i_or0() + 1);
            }
            "PublishDeferred" => {
                row[YIELDS] = Cell::I(row[YIELDS].i_or0() + 1);
            }
            "StallDetected" => {
                let reason = format!(
                    "stalled ({}) for {} s: {}",
                    ev.str("kind"),
                    fmt_1f(ev.f("since_s").unwrap_or(0.0)),
                    ev.str("detail")
                );
                row[REASON] = Cell::S(reason.trim_end_matches([':', ' ']).to_string());
                if ev.s("kind") == Some("handoff") {
                    row[QUEUED_AT] = Cell::T(ts);
                    row[REDRIVES] = Cell::I(row[REDRIVES].i_or0() + 1);
                } else if FREE_STALL_KINDS.contains(&ev.str("kind")) {
                    row[YIELDS] = Cell::I(row[YIELDS].i_or0() + 1);
                }
            }
            "RetryScheduled" => {
                row[STATE] = Cell::S(ST_RETRY_SCHEDULED.into());
                row[ERROR_CLASS] = s("error_class");
                row[RETRY_NEXT_ATTEMPT] = ev.i("next_attempt").map_or(Cell::N, Cell::I);
                row[RETRY_DUE_AT] = Cell::T(retry_due.unwrap());
                row[LEASED_UNTIL] = Cell::N;
            }
            "ResultReused" => {
                row[REUSED_FROM] = s("reused_job_id");
                row[MASTER_URL] = s("master_url");
                row[RENDITIONS] = ev.json_cell("renditions")?;
            }
            "Published" => {
                row[MASTER_URL] = s("master_url");
                row[RENDITIONS] = ev.json_cell("renditions")?;
            }
            "JobReplayed" => {
                row[STATE] = Cell::S(ST_QUEUED.into());
                row[COMPLETED_AT] = Cell::N;
                row[ERROR_CLASS] = Cell::N;
                row[BUDGET_BASE] = row[ATTEMPT].clone();
                row[YIELDS] = Cell::I(0);
                row[REASON] = Cell::S(format!("replayed by {}: {}", ev.str("operator"), ev.str("reason")));
            }
            // JobCompleted, JobFailed, ...: the one rule of schemas/lifecycle.json "ending" (as `lifecycle.evolve`).
            _ if ENDING.iter().any(|e| e.0 == kind) => {
                let (_, state, copies, clears) = ENDING.iter().find(|e| e.0 == kind).unwrap();
                row[STATE] = Cell::S((*state).into());
                row[COMPLETED_AT] = Cell::T(ts);
                row[LEASED_UNTIL] = Cell::N;
                for &c in copies.iter() {
                    row[c] = opt_s(ev.s(COLUMNS[c]));
                }
                for &c in clears.iter() {
                    row[c] = Cell::N;
                }
            }
            // PublishIntended, CheckpointRecorded, ...: evidence with bookkeeping only.
            _ if BOOKKEEPING_EVENTS.contains(&kind) => {}
            // A kind lifecycle.json does not list as bookkeeping and this engine has no rule for:
            // the Python engine folds it.
            _ => return Err(format!("{kind} has no native fold rule (schemas/lifecycle.json)").into()),
        }
        Ok((true, false))
    }
}

#[pymodule]
fn tapeline_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add("Unsupported", m.py().get_type::<Unsupported>())?;
    m.add("LIFECYCLE_JSON", SOURCE_JSON)?;
    Ok(())
}
