//! Avro: schemas (from the Python dicts of `domain/codec.py`), values, and a resolving decoder
//! (writer schema -> reader schema, fields missing in the writer take the reader's default).

use std::collections::HashMap;
use std::rc::Rc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

/// A decoded value, already in the reader's shape.
#[derive(Clone, Debug)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Double(f64),
    Str(String),
    Bytes(Vec<u8>),
    /// Microseconds since the Unix epoch (timestamp-micros).
    Ts(i64),
    Record(Rc<Vec<String>>, Vec<Value>),
    Array(Vec<Value>),
    Map(Vec<(String, Value)>),
}

#[derive(Clone, Debug)]
pub enum Schema {
    Null,
    Bool,
    Int,
    Long,
    Float,
    Double,
    Str,
    Bytes,
    TsMicros,
    Record(Rc<Record>),
    Array(Box<Schema>),
    Map(Box<Schema>),
    Union(Vec<Schema>),
    Enum(Vec<String>),
    Fixed(usize),
}

#[derive(Debug)]
pub struct Record {
    pub name: String,
    pub names: Rc<Vec<String>>,
    pub fields: Vec<Field>,
}

#[derive(Debug)]
pub struct Field {
    pub name: String,
    pub schema: Schema,
    pub default: Option<Py<PyAny>>,
}

pub type Named = HashMap<String, Schema>;

fn short(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
}

/// Parse a schema given as the Python object `json.loads` makes of it.
pub fn parse(obj: &Bound<'_, PyAny>, named: &mut Named) -> Result<Schema, String> {
    if let Ok(s) = obj.downcast::<PyString>() {
        let s = s.to_str().map_err(|e| e.to_string())?;
        return Ok(match s {
            "null" => Schema::Null,
            "boolean" => Schema::Bool,
            "int" => Schema::Int,
            "long" => Schema::Long,
            "float" => Schema::Float,
            "double" => Schema::Double,
            "string" => Schema::Str,
            "bytes" => Schema::Bytes,
            other => named
                .get(other)
                .or_else(|| named.get(short(other)))
                .cloned()
                .ok_or_else(|| format!("unknown named type {other}"))?,
        });
    }
    if let Ok(list) = obj.downcast::<PyList>() {
        let mut branches = Vec::new();
        for item in list.iter() {
            branches.push(parse(&item, named)?);
        }
        return Ok(Schema::Union(branches));
    }
    let dict = obj.downcast::<PyDict>().map_err(|_| "schema is not a str, list or dict".to_string())?;
    let get = |key: &str| -> Option<Bound<'_, PyAny>> { dict.get_item(key).ok().flatten() };
    let kind = get("type").ok_or("schema without type")?;
    if let Ok(s) = kind.downcast::<PyString>() {
        let s = s.to_str().map_err(|e| e.to_string())?.to_string();
        let logical = get("logicalType").and_then(|v| v.extract::<String>().ok());
        match s.as_str() {
            "record" | "error" => {
                let name: String = get("name").ok_or("record without name")?.extract().map_err(|e: PyErr| e.to_string())?;
                let fields_obj = get("fields").ok_or("record without fields")?;
                let fields_list = fields_obj.downcast::<PyList>().map_err(|_| "fields is not a list")?;
                let mut fields = Vec::new();
                for f in fields_list.iter() {
                    let fd = f.downcast::<PyDict>().map_err(|_| "field is not a dict")?;
                    let fname: String = fd.get_item("name").ok().flatten().ok_or("field without name")?.extract().map_err(|e: PyErr| e.to_string())?;
                    let ftype = fd.get_item("type").ok().flatten().ok_or("field without type")?;
                    let schema = parse(&ftype, named)?;
                    let default = fd.get_item("default").ok().flatten().map(|d| d.unbind());
                    fields.push(Field { name: fname, schema, default });
                }
                let names = Rc::new(fields.iter().map(|f| f.name.clone()).collect());
                let rec = Schema::Record(Rc::new(Record { name: short(&name).to_string(), names, fields }));
                named.insert(name.clone(), rec.clone());
                named.insert(short(&name).to_string(), rec.clone());
                Ok(rec)
            }
            "array" => Ok(Schema::Array(Box::new(parse(&get("items").ok_or("array without items")?, named)?))),
            "map" => Ok(Schema::Map(Box::new(parse(&get("values").ok_or("map without values")?, named)?))),
            "enum" => {
                let symbols: Vec<String> = get("symbols").ok_or("enum without symbols")?.extract().map_err(|e: PyErr| e.to_string())?;
                let e = Schema::Enum(symbols);
                if let Some(n) = get("name").and_then(|v| v.extract::<String>().ok()) {
                    named.insert(short(&n).to_string(), e.clone());
                    named.insert(n, e.clone());
                }
                Ok(e)
            }
            "fixed" => {
                let size: usize = get("size").ok_or("fixed without size")?.extract().map_err(|e: PyErr| e.to_string())?;
                Ok(Schema::Fixed(size))
            }
            "long" if logical.as_deref() == Some("timestamp-micros") => Ok(Schema::TsMicros),
            _ if logical.is_some() => Err(format!("logical type {logical:?} on {s} is not supported")),
            _ => parse(&kind, named),
        }
    } else {
        parse(&kind, named)
    }
}

/// How to read one writer value into the reader's shape.
#[derive(Debug)]
pub enum Plan {
    Null,
    Bool,
    /// An Avro int: a value outside int32 is refused, as the Python readers refuse it.
    Int,
    Long,
    LongToDouble,
    Float,
    Double,
    Str,
    Bytes,
    Ts,
    Record { names: Rc<Vec<String>>, steps: Vec<Step>, defaults: Vec<(usize, Value)>, width: usize },
    Array(Box<Plan>),
    Map(Box<Plan>),
    /// The writer's union: one plan per writer branch (None: no reader branch takes it).
    Union(Vec<Option<Plan>>),
    Enum(Vec<String>),
    Fixed(usize),
    Skip(Schema),
}

#[derive(Debug)]
pub enum Step {
    Read(usize, Plan),
    Skip(Schema),
}

fn same_kind(w: &Schema, r: &Schema) -> bool {
    matches!(
        (w, r),
        (Schema::Null, Schema::Null)
            | (Schema::Bool, Schema::Bool)
            | (Schema::Int | Schema::Long, Schema::Int | Schema::Long)
            | (Schema::Int | Schema::Long | Schema::Float | Schema::Double, Schema::Double | Schema::Float)
            | (Schema::Str, Schema::Str)
            | (Schema::Bytes, Schema::Bytes)
            | (Schema::TsMicros | Schema::Long, Schema::TsMicros)
            | (Schema::TsMicros, Schema::Long)
            | (Schema::Array(_), Schema::Array(_))
            | (Schema::Map(_), Schema::Map(_))
            | (Schema::Enum(_), Schema::Enum(_))
            | (Schema::Fixed(_), Schema::Fixed(_))
    ) || matches!((w, r), (Schema::Record(a), Schema::Record(b)) if a.name == b.name)
}

/// The plan that reads `w` (writer) as `r` (reader). Errors name what cannot be resolved.
pub fn resolve(py: Python<'_>, w: &Schema, r: &Schema) -> Result<Plan, String> {
    if let Schema::Union(wb) = w {
        let mut plans = Vec::new();
        for branch in wb {
            plans.push(resolve(py, branch, r).ok());
        }
        return Ok(Plan::Union(plans));
    }
    if let Schema::Union(rb) = r {
        // A non-union writer into a union reader: the first reader branch of the same kind.
        let exact = rb.iter().find(|b| std::mem::discriminant(*b) == std::mem::discriminant(w) && same_kind(w, b));
        let branch = exact.or_else(|| rb.iter().find(|b| same_kind(w, b))).ok_or("no union branch matches")?;
        return resolve(py, w, branch);
    }
    Ok(match (w, r) {
        (Schema::Null, Schema::Null) => Plan::Null,
        (Schema::Bool, Schema::Bool) => Plan::Bool,
        (Schema::Int, Schema::Int | Schema::Long) => Plan::Int,
        (Schema::Long, Schema::Int | Schema::Long) => Plan::Long,
        (Schema::Int | Schema::Long, Schema::Double | Schema::Float) => Plan::LongToDouble,
        (Schema::Float, Schema::Double | Schema::Float) => Plan::Float,
        (Schema::Double, Schema::Double) => Plan::Double,
        (Schema::Str, Schema::Str) => Plan::Str,
        (Schema::Bytes, Schema::Bytes) => Plan::Bytes,
        (Schema::TsMicros, Schema::TsMicros) | (Schema::Long, Schema::TsMicros) => Plan::Ts,
        (Schema::TsMicros, Schema::Long) => Plan::Long,
        (Schema::Array(wi), Schema::Array(ri)) => Plan::Array(Box::new(resolve(py, wi, ri)?)),
        (Schema::Map(wi), Schema::Map(ri)) => Plan::Map(Box::new(resolve(py, wi, ri)?)),
        (Schema::Enum(ws), Schema::Enum(_)) => Plan::Enum(ws.clone()),
        (Schema::Fixed(a), Schema::Fixed(b)) if a == b => Plan::Fixed(*a),
        (Schema::Record(wr), Schema::Record(rr)) => {
            let mut steps = Vec::new();
            let mut found = vec![false; rr.fields.len()];
            for wf in &wr.fields {
                match rr.fields.iter().position(|f| f.name == wf.name) {
                    Some(i) => {
                        found[i] = true;
                        steps.push(Step::Read(i, resolve(py, &wf.schema, &rr.fields[i].schema)?));
                    }
                    None => steps.push(Step::Skip(wf.schema.clone())),
                }
            }
            let mut defaults = Vec::new();
            for (i, f) in rr.fields.iter().enumerate() {
                if !found[i] {
                    let d = f.default.as_ref().ok_or_else(|| format!("field {} has no default", f.name))?;
                    defaults.push((i, default_value(d.bind(py), &f.schema)?));
                }
            }
            Plan::Record { names: rr.names.clone(), steps, defaults, width: rr.fields.len() }
        }
        _ => return Err(format!("writer {w:?} cannot be read as {r:?}")),
    })
}

/// A field default (JSON, as Python objects) as a value of `schema` (a union's default is of its first branch).
fn default_value(obj: &Bound<'_, PyAny>, schema: &Schema) -> Result<Value, String> {
    let e = |x: PyErr| x.to_string();
    Ok(match schema {
        Schema::Union(b) => return default_value(obj, b.first().ok_or("empty union")?),
        Schema::Null => {
            if !obj.is_none() {
                return Err("null default is not null".into());
            }
            Value::Null
        }
        Schema::Bool => Value::Bool(obj.extract().map_err(e)?),
        Schema::Int | Schema::Long => Value::Int(obj.extract().map_err(e)?),
        Schema::TsMicros => Value::Ts(obj.extract().map_err(e)?),
        Schema::Float | Schema::Double => Value::Double(obj.extract().map_err(e)?),
        Schema::Str => Value::Str(obj.extract().map_err(e)?),
        Schema::Array(items) => {
            let list = obj.downcast::<PyList>().map_err(|_| "array default is not a list")?;
            let mut out = Vec::new();
            for it in list.iter() {
                out.push(default_value(&it, items)?);
            }
            Value::Array(out)
        }
        Schema::Record(r) => {
            let d = obj.downcast::<PyDict>().map_err(|_| "record default is not a dict")?;
            let mut out = Vec::new();
            for f in &r.fields {
                match d.get_item(&f.name).ok().flatten() {
                    Some(v) => out.push(default_value(&v, &f.schema)?),
                    None => match &f.default {
                        Some(dd) => out.push(default_value(dd.bind(obj.py()), &f.schema)?),
                        None => return Err(format!("record default misses {}", f.name)),
                    },
                }
            }
            Value::Record(r.names.clone(), out)
        }
        _ => return Err(format!("default of {schema:?} not supported")),
    })
}

pub struct Reader<'a> {
    pub buf: &'a [u8],
    pub pos: usize,
    /// Whether a string read held a NUL character (PostgreSQL text cannot store it).
    pub nul: bool,
}

type R<T> = Result<T, &'static str>;

/// datetime's range (year 1 to 9999), in microseconds since the Unix epoch.
pub const TS_MIN: i64 = -62_135_596_800_000_000;
pub const TS_MAX: i64 = 253_402_300_799_999_999;

impl<'a> Reader<'a> {
    fn long(&mut self) -> R<i64> {
        let mut value: u64 = 0;
        let mut shift = 0;
        loop {
            let b = *self.buf.get(self.pos).ok_or("truncated varint")?;
            self.pos += 1;
            if shift >= 64 {
                return Err("varint too long");
            }
            value |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
        }
        Ok(((value >> 1) as i64) ^ -((value & 1) as i64))
    }
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or("length overflow")?;
        let s = self.buf.get(self.pos..end).ok_or("truncated")?;
        self.pos = end;
        Ok(s)
    }
    fn len(&mut self) -> R<usize> {
        let n = self.long()?;
        if n < 0 {
            return Err("negative length");
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> R<String> {
        let n = self.len()?;
        let b = self.take(n)?;
        if b.contains(&0) {
            self.nul = true;
        }
        std::str::from_utf8(b).map(|s| s.to_string()).map_err(|_| "invalid utf-8")
    }
    fn f64(&mut self) -> R<f64> {
        let b = self.take(8)?;
        Ok(f64::from_le_bytes(b.try_into().unwrap()))
    }
    fn f32(&mut self) -> R<f64> {
        let b = self.take(4)?;
        Ok(f32::from_le_bytes(b.try_into().unwrap()) as f64)
    }
    fn bool(&mut self) -> R<bool> {
        match self.take(1)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err("boolean byte not 0 or 1"),
        }
    }
    fn block(&mut self) -> R<usize> {
        let n = self.long()?;
        if n < 0 {
            self.long()?; // the block's size in bytes
            return Ok(n.unsigned_abs() as usize);
        }
        Ok(n as usize)
    }

    pub fn read(&mut self, plan: &Plan) -> R<Value> {
        Ok(match plan {
            Plan::Null => Value::Null,
            Plan::Bool => Value::Bool(self.bool()?),
            Plan::Int => {
                let v = self.long()?;
                if i32::try_from(v).is_err() {
                    return Err("int out of range");
                }
                Value::Int(v)
            }
            Plan::Long => Value::Int(self.long()?),
            Plan::LongToDouble => Value::Double(self.long()? as f64),
            Plan::Float => Value::Double(self.f32()?),
            Plan::Double => Value::Double(self.f64()?),
            Plan::Str => Value::Str(self.string()?),
            Plan::Bytes => {
                let n = self.len()?;
                Value::Bytes(self.take(n)?.to_vec())
            }
            Plan::Ts => {
                let v = self.long()?;
                if !(TS_MIN..=TS_MAX).contains(&v) {
                    return Err("timestamp out of datetime's range");
                }
                Value::Ts(v)
            }
            Plan::Record { names, steps, defaults, width } => {
                let mut out: Vec<Value> = vec![Value::Null; *width];
                for step in steps {
                    match step {
                        Step::Read(i, p) => out[*i] = self.read(p)?,
                        Step::Skip(s) => self.skip(s)?,
                    }
                }
                for (i, v) in defaults {
                    out[*i] = v.clone();
                }
                Value::Record(names.clone(), out)
            }
            Plan::Array(item) => {
                let mut out = Vec::new();
                loop {
                    let n = self.block()?;
                    if n == 0 {
                        break;
                    }
                    for _ in 0..n {
                        out.push(self.read(item)?);
                    }
                }
                Value::Array(out)
            }
            Plan::Map(item) => {
                let mut out = Vec::new();
                loop {
                    let n = self.block()?;
                    if n == 0 {
                        break;
                    }
                    for _ in 0..n {
                        let k = self.string()?;
                        out.push((k, self.read(item)?));
                    }
                }
                Value::Map(out)
            }
            Plan::Union(branches) => {
                let i = self.long()?;
                if i < 0 || i as usize >= branches.len() {
                    return Err("union index out of range");
                }
                match &branches[i as usize] {
                    Some(p) => self.read(p)?,
                    None => return Err("union branch not readable"),
                }
            }
            Plan::Enum(symbols) => {
                let i = self.long()?;
                if i < 0 || i as usize >= symbols.len() {
                    return Err("enum index out of range");
                }
                Value::Str(symbols[i as usize].clone())
            }
            Plan::Fixed(n) => Value::Bytes(self.take(*n)?.to_vec()),
            Plan::Skip(s) => {
                self.skip(s)?;
                Value::Null
            }
        })
    }

    fn skip(&mut self, s: &Schema) -> R<()> {
        match s {
            Schema::Null => {}
            Schema::Bool => {
                self.bool()?;
            }
            Schema::Int | Schema::Long | Schema::TsMicros | Schema::Enum(_) => {
                self.long()?;
            }
            Schema::Float => {
                self.take(4)?;
            }
            Schema::Double => {
                self.take(8)?;
            }
            Schema::Str | Schema::Bytes => {
                let n = self.len()?;
                self.take(n)?;
            }
            Schema::Fixed(n) => {
                self.take(*n)?;
            }
            Schema::Record(r) => {
                for f in &r.fields {
                    self.skip(&f.schema)?;
                }
            }
            Schema::Array(item) => loop {
                let n = self.block()?;
                if n == 0 {
                    break;
                }
                for _ in 0..n {
                    self.skip(item)?;
                }
            },
            Schema::Map(item) => loop {
                let n = self.block()?;
                if n == 0 {
                    break;
                }
                for _ in 0..n {
                    self.string()?;
                    self.skip(item)?;
                }
            },
            Schema::Union(b) => {
                let i = self.long()?;
                if i < 0 || i as usize >= b.len() {
                    return Err("union index out of range");
                }
                self.skip(&b[i as usize])?;
            }
        }
        Ok(())
    }
}
