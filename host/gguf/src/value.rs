//! Metadata values and their on-disk type ids.

/// One GGUF metadata value. Arrays may nest; every element of one array has the same type.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

// On-disk value type ids (GGUF spec, `gguf_type`).
pub(crate) const T_U8: u32 = 0;
pub(crate) const T_I8: u32 = 1;
pub(crate) const T_U16: u32 = 2;
pub(crate) const T_I16: u32 = 3;
pub(crate) const T_U32: u32 = 4;
pub(crate) const T_I32: u32 = 5;
pub(crate) const T_F32: u32 = 6;
pub(crate) const T_BOOL: u32 = 7;
pub(crate) const T_STRING: u32 = 8;
pub(crate) const T_ARRAY: u32 = 9;
pub(crate) const T_U64: u32 = 10;
pub(crate) const T_I64: u32 = 11;
pub(crate) const T_F64: u32 = 12;

/// Name of an on-disk value type id, for error messages.
pub(crate) fn value_type_name(type_id: u32) -> Option<&'static str> {
    Some(match type_id {
        T_U8 => "u8",
        T_I8 => "i8",
        T_U16 => "u16",
        T_I16 => "i16",
        T_U32 => "u32",
        T_I32 => "i32",
        T_F32 => "f32",
        T_BOOL => "bool",
        T_STRING => "string",
        T_ARRAY => "array",
        T_U64 => "u64",
        T_I64 => "i64",
        T_F64 => "f64",
        _ => return None,
    })
}

impl Value {
    /// Any integer variant whose value is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// Any integer variant whose value fits an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any float or integer variant (64-bit integers may round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Short type name ("u32", "string", "array", ...), for messages.
    pub fn type_name(&self) -> &'static str {
        value_type_name(self.type_id()).unwrap_or("?")
    }

    /// The on-disk type id of this value.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => T_U8,
            Value::I8(_) => T_I8,
            Value::U16(_) => T_U16,
            Value::I16(_) => T_I16,
            Value::U32(_) => T_U32,
            Value::I32(_) => T_I32,
            Value::F32(_) => T_F32,
            Value::Bool(_) => T_BOOL,
            Value::String(_) => T_STRING,
            Value::Array(_) => T_ARRAY,
            Value::U64(_) => T_U64,
            Value::I64(_) => T_I64,
            Value::F64(_) => T_F64,
        }
    }

    /// Like `type_name`, but arrays say what they hold: "array of string", "array of array of u8".
    pub fn describe(&self) -> String {
        match self {
            Value::Array(a) => match a.first() {
                Some(first) => format!("array of {}", first.describe()),
                None => "empty array".to_string(),
            },
            v => v.type_name().to_string(),
        }
    }
}
