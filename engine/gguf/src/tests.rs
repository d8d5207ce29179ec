//! The reader against files gguf-py wrote (the reference writer and
//! de-quantizer), and against hand-made broken headers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::*;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf")
}

#[derive(Deserialize)]
struct Reference {
    tensors: BTreeMap<String, RefTensor>,
    metadata: BTreeMap<String, RefValue>,
    nested_array_file: NestedFile,
}

#[derive(Deserialize)]
struct NestedFile {
    file: String,
    metadata: BTreeMap<String, RefValue>,
}

/// A metadata entry as gguf-py wrote it.
#[derive(Deserialize)]
struct RefValue {
    #[serde(rename = "type")]
    ty: String,
    item_type: Option<String>,
    value: serde_json::Value,
}

#[derive(Deserialize)]
struct RefTensor {
    #[serde(rename = "type")]
    ty: String,
    /// ggml order: `[ne0, ne1]`.
    shape: Vec<u64>,
    values: Vec<f32>,
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(fixture_dir().join("quant_types.json"))
        .expect("quant_types.json (engine/tests/fixtures/gguf/make_quant_fixture.py)");
    serde_json::from_str(&text).expect("valid reference")
}

#[test]
fn every_type_dequantizes_as_gguf_py_does() {
    let file = GgufFile::open(&fixture_dir().join("quant_types.gguf")).expect("open fixture");
    let reference = reference();
    let mut seen = Vec::new();
    for (name, want) in &reference.tensors {
        let (info, bytes) = file.tensor(name).unwrap_or_else(|| panic!("tensor {name}"));
        assert_eq!(info.ty.name(), want.ty, "{name}");
        assert_eq!(info.dims, want.shape, "{name}");
        let got = quant::dequantize_to_vec(info.ty, bytes, info.elements() as usize);
        assert_eq!(got.len(), want.values.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want.values).enumerate() {
            // gguf-py computes in f32 like ggml; allow only rounding of the
            // last bit from a different operation order.
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name}[{i}]: {g} vs gguf-py {w}"
            );
        }
        seen.push(info.ty);
    }
    for ty in GgmlType::ALL {
        assert!(seen.contains(&ty), "the fixture covers {}", ty.name());
    }
}

#[test]
fn metadata_of_every_value_type_reads_back() {
    let reference = reference();
    let files = [
        ("quant_types.gguf", &reference.metadata),
        (
            reference.nested_array_file.file.as_str(),
            &reference.nested_array_file.metadata,
        ),
    ];
    for (name, metadata) in files {
        let file = GgufFile::open(&fixture_dir().join(name)).expect("open fixture");
        assert_eq!(file.metadata().len(), metadata.len(), "{name}: key count");
        for (key, want) in metadata {
            let got = file.get(key).unwrap_or_else(|| panic!("{name}: key {key}"));
            assert!(
                same(got, &want.ty, want.item_type.as_deref(), &want.value),
                "{name} {key}: read {got:?}, gguf-py wrote {} {:?}",
                want.ty,
                want.value
            );
        }
    }
}

/// gguf-py's name for a value's type.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::U8(_) => "u8",
        Value::I8(_) => "i8",
        Value::U16(_) => "u16",
        Value::I16(_) => "i16",
        Value::U32(_) => "u32",
        Value::I32(_) => "i32",
        Value::U64(_) => "u64",
        Value::I64(_) => "i64",
        Value::F32(_) => "f32",
        Value::F64(_) => "f64",
        Value::Bool(_) => "bool",
        Value::String(_) => "string",
        Value::Array(_) => "array",
    }
}

/// Same type and value; integers exactly, f32 to its own precision.
fn same(got: &Value, ty: &str, item_ty: Option<&str>, want: &serde_json::Value) -> bool {
    if type_name(got) != ty {
        return false;
    }
    match (got, want) {
        (Value::String(s), serde_json::Value::String(w)) => s == w,
        (Value::Bool(b), serde_json::Value::Bool(w)) => b == w,
        (Value::Array(items), serde_json::Value::Array(w)) => {
            let item_ty = item_ty.unwrap_or("?");
            items.len() == w.len()
                && items.iter().zip(w).all(|(g, w)| match (g, w) {
                    // Nested arrays: the inner type is checked by value.
                    (Value::Array(_), _) => {
                        item_ty == "array" && same(g, "array", Some(type_name_of_inner(g)), w)
                    }
                    _ => same(g, item_ty, None, w),
                })
        }
        (Value::F32(g), serde_json::Value::Number(n)) => n.as_f64().is_some_and(|w| *g == w as f32),
        (Value::F64(g), serde_json::Value::Number(n)) => n.as_f64() == Some(*g),
        (Value::I64(g), serde_json::Value::Number(n)) => n.as_i64() == Some(*g),
        (Value::I8(_) | Value::I16(_) | Value::I32(_), serde_json::Value::Number(n)) => {
            n.as_i64() == got.as_f64().map(|v| v as i64)
        }
        (v, serde_json::Value::Number(n)) => n.as_u64().is_some() && n.as_u64() == v.as_u64(),
        _ => false,
    }
}

fn type_name_of_inner(v: &Value) -> &'static str {
    v.as_array().and_then(|a| a.first()).map_or("?", type_name)
}

/// A minimal GGUF writer for broken-file cases.
fn header(version: u32, tensors: u64, kvs: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(MAGIC.to_le_bytes());
    b.extend(version.to_le_bytes());
    b.extend(tensors.to_le_bytes());
    b.extend(kvs.to_le_bytes());
    b
}

fn string(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn tensor_info(b: &mut Vec<u8>, name: &str, dims: &[u64], ty: u32, offset: u64) {
    string(b, name);
    b.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend(d.to_le_bytes());
    }
    b.extend(ty.to_le_bytes());
    b.extend(offset.to_le_bytes());
}

fn open_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, bytes).expect("write");
    GgufFile::open(&path)
}

fn message(bytes: &[u8]) -> String {
    open_bytes(bytes).expect_err("broken file").to_string()
}

#[test]
fn a_small_file_reads_back_with_its_tensor_bytes() {
    let mut b = header(3, 1, 1);
    string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "llama");
    tensor_info(&mut b, "w", &[2, 3], 0, 0);
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    for i in 0..6 {
        b.extend((i as f32).to_le_bytes());
    }
    let file = open_bytes(&b).expect("valid file");
    assert_eq!(
        file.get("general.architecture").and_then(Value::as_str),
        Some("llama")
    );
    let (info, bytes) = file.tensor("w").expect("tensor w");
    assert_eq!(info.shape(), vec![3, 2]);
    assert_eq!(
        quant::dequantize_to_vec(info.ty, bytes, 6),
        vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
}

#[test]
fn broken_files_are_refused_by_what_is_wrong() {
    assert!(message(b"GGML\x03\0\0\0").contains("not a GGUF file"));
    assert!(message(&header(1, 0, 0)).contains("version 1"));
    let mut be = header(3, 0, 0);
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(message(&be).contains("big-endian"));
    assert!(message(&header(3, 1, 0)).contains("truncated"));

    let mut unknown = header(3, 1, 0);
    tensor_info(&mut unknown, "blk.0.attn_q.weight", &[32, 1], 11, 0);
    let m = message(&unknown);
    assert!(
        m.contains("blk.0.attn_q.weight") && m.contains("Q3_K"),
        "{m}"
    );

    let mut outside = header(3, 1, 0);
    tensor_info(&mut outside, "w", &[64, 64], 0, 0);
    assert!(message(&outside).contains("outside the file"));

    let mut partial = header(3, 1, 0);
    tensor_info(&mut partial, "w", &[48, 1], 2, 0);
    assert!(message(&partial).contains("whole number of Q4_0 blocks"));

    let mut huge = header(3, 0, 1);
    string(&mut huge, "tokenizer.ggml.tokens");
    huge.extend(9u32.to_le_bytes());
    huge.extend(8u32.to_le_bytes());
    huge.extend(u64::MAX.to_le_bytes());
    assert!(message(&huge).contains("overruns"));
}
