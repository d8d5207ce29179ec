//! GGUF, the single-file model format of llama.cpp, Ollama and LM Studio.
//!
//! - [`GgufFile`]: a memory-mapped file: its metadata (typed [`Value`]s by
//!   key) and its tensor directory, each tensor's bytes borrowed straight
//!   from the map (no copy, so a quantized model stays quantized).
//! - [`quant`]: ggml's tensor types ([`GgmlType`]): block geometry and the
//!   reference de-quantization of every type the engine serves.
//!
//! Versions 2 and 3 (little-endian) are read; version 1 (32-bit counts, from
//! 2023) and big-endian files are refused by name. The crates published for
//! the container (`gguf-rs`, `gguf-rs-lib`) copy tensor data into owned
//! buffers and know no K-quant geometry; what the engine needs is ~200
//! lines over `memmap2`, so it is written here.

#![deny(unsafe_code)]

pub mod quant;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use quant::GgmlType;

/// `"GGUF"` read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// Data alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Guard against absurd counts in a corrupt header (a real file has
/// hundreds of tensors and tens of keys; vocabularies are arrays).
const MAX_ENTRIES: u64 = 1 << 24;

/// What can go wrong reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("reading {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer type that fits a u64 (GGUF writers differ in the width
    /// they pick for counts and ids).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer or float type as an f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
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
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (innermost) dimension, so a
    /// linear layer's weight is `[in_features, out_features]` here and its
    /// rows (one per output feature) are contiguous runs of blocks.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte offset from the start of the data section.
    offset: u64,
    /// Bytes of the tensor's data.
    size: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The dims outermost first (the row-major shape a safetensors file or
    /// numpy would give): `[out_features, in_features]` for a weight.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A memory-mapped GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: BTreeMap<String, usize>,
    data_start: u64,
}

impl GgufFile {
    /// Maps and parses `path`, checking that every tensor lies inside it.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let map = map_read_only(&file).map_err(io)?;
        Self::parse(path.to_path_buf(), map)
    }

    /// Whether `path` is a file (not a model directory) that starts with
    /// the GGUF magic.
    pub fn is_gguf(path: &Path) -> bool {
        use std::io::Read;
        let mut magic = [0u8; 4];
        path.is_file()
            && File::open(path)
                .and_then(|mut f| f.read_exact(&mut magic))
                .is_ok_and(|()| u32::from_le_bytes(magic) == MAGIC)
    }

    fn parse(path: PathBuf, map: memmap2::Mmap) -> Result<Self, GgufError> {
        let mut r = Reader {
            bytes: &map,
            pos: 0,
        };
        let bad = |message: String| GgufError::Format {
            path: path.clone(),
            message,
        };
        let magic = r.u32().map_err(&bad)?;
        if magic != MAGIC {
            return Err(bad(format!(
                "not a GGUF file (starts with {:?})",
                magic.to_le_bytes()
            )));
        }
        let version = r.u32().map_err(&bad)?;
        match version {
            2 | 3 => {}
            1 => return Err(bad("GGUF version 1 is not supported (re-convert the model with a llama.cpp from 2024 or later)".to_owned())),
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(bad("big-endian GGUF files are not supported".to_owned()));
            }
            v => return Err(bad(format!("unknown GGUF version {v}"))),
        }
        let tensor_count = r.count("tensor count").map_err(&bad)?;
        let kv_count = r.count("metadata count").map_err(&bad)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string().map_err(&bad)?;
            let ty = r.u32().map_err(&bad)?;
            let value = r
                .value(ty, 0)
                .map_err(|e| bad(format!("metadata {key}: {e}")))?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut by_name = BTreeMap::new();
        for _ in 0..tensor_count {
            let name = r.string().map_err(&bad)?;
            let n_dims = r.u32().map_err(&bad)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(bad(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>, _>>();
            let dims = dims.map_err(&bad)?;
            let ty_id = r.u32().map_err(&bad)?;
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
                bad(format!(
                    "tensor {name} has ggml type {ty_id} ({}), which Sluice does not read (supported: {})",
                    quant::type_name(ty_id),
                    GgmlType::ALL.map(GgmlType::name).join(", ")
                ))
            })?;
            let offset = r.u64().map_err(&bad)?;
            let elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("tensor {name}: dims {dims:?} overflow")))?;
            if dims[0] % ty.block_elements() as u64 != 0 {
                return Err(bad(format!(
                    "tensor {name}: row of {} elements is not a whole number of {} blocks of {}",
                    dims[0],
                    ty.name(),
                    ty.block_elements()
                )));
            }
            let size = elements / ty.block_elements() as u64 * ty.block_bytes() as u64;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(bad(format!("tensor {name} appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                size,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| bad(format!("general.alignment {v:?} is not a power of two")))?,
        };
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let len = map.len() as u64;
        for t in &tensors {
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.size));
            if t.offset % alignment != 0 || end.is_none_or(|e| e > len) {
                return Err(bad(format!(
                    "tensor {} ({} bytes at offset {}) lies outside the file's {len} bytes or is misaligned",
                    t.name, t.size, t.offset
                )));
            }
        }
        Ok(GgufFile {
            path,
            map,
            version,
            metadata,
            tensors,
            by_name,
            data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// Every metadata key and value.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's directory entry and its bytes in the file.
    pub fn tensor(&self, name: &str) -> Option<(&TensorInfo, &[u8])> {
        let info = self.tensor_info(name)?;
        let start = (self.data_start + info.offset) as usize;
        Some((info, &self.map[start..start + info.size as usize]))
    }

    /// Every token id that ends generation: `tokenizer.ggml.eos_token_id`,
    /// then the end-of-turn and end-of-message ids when present, each once.
    /// A key that is not a token id is an error naming it.
    pub fn eos_token_ids(&self) -> Result<Vec<u32>, GgufError> {
        let mut ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = self.token_id(key)?
                && !ids.contains(&id)
            {
                ids.push(id);
            }
        }
        Ok(ids)
    }

    /// The token id under `key`, if present.
    pub fn token_id(&self, key: &str) -> Result<Option<u32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.error(format!("{key} must be a token id, got {v:?}"))),
        }
    }

    /// A format error about this file (for callers interpreting metadata).
    pub fn error(&self, message: impl Into<String>) -> GgufError {
        GgufError::Format {
            path: self.path.clone(),
            message: message.into(),
        }
    }
}

#[allow(unsafe_code)]
fn map_read_only(file: &File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only; model files are not modified while a
    // server has them open (the same contract as every mmap-based loader:
    // llama.cpp, safetensors).
    unsafe { memmap2::Mmap::map(file) }
}

/// A cursor over the header, every read bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

/// Arrays nest at most this deep (the spec allows nesting; real files use 1).
const MAX_DEPTH: usize = 4;

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| format!("truncated header at byte {}", self.pos))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn count(&mut self, what: &str) -> Result<u64, String> {
        let n = self.u64()?;
        if n > MAX_ENTRIES {
            return Err(format!("{what} {n} is implausible (corrupt header?)"));
        }
        Ok(n)
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        let len = usize::try_from(len).map_err(|_| format!("string length {len}"))?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("string is not UTF-8: {e}"))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("bool byte {b}")),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err("arrays nested too deep".to_owned());
                }
                let item = self.u32()?;
                let len = self.u64()?;
                // Every item takes at least one byte: a length beyond the
                // remaining bytes is corrupt, not a reason to allocate.
                if len > (self.bytes.len() - self.pos) as u64 {
                    return Err(format!("array of {len} items overruns the file"));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(item, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            t => return Err(format!("unknown value type {t}")),
        })
    }
}

#[cfg(test)]
mod tests;
