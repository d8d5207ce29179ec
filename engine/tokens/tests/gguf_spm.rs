//! A SentencePiece vocabulary from a GGUF file (`tokenizer.ggml.model =
//! "llama"`) tokenizes exactly as llama.cpp tokenizes it.
//!
//! `engine/tests/fixtures/gguf/make_spm_vocab.py` wrote Mistral 7B Instruct
//! v0.3's real vocabulary (32768 pieces, byte fallback, control pieces such
//! as `[INST]`) into a GGUF as llama.cpp's converter does, and recorded
//! llama.cpp's ids and text for a set of strings: spaces in every position,
//! newlines and tabs, digits, accents, CJK, emoji and control characters
//! (byte fallback), code, and control-token text.

use std::path::PathBuf;

use serde::Deserialize;
use sluice_tokens::Tokenizer;

#[derive(Deserialize)]
struct Record {
    cases: Vec<Case>,
    phi3: Phi3,
}

/// The same vocabulary under a Phi-3 name with Phi-3's special tokens
/// (patched in place, same lengths), and llama.cpp's ids for it.
#[derive(Deserialize)]
struct Phi3 {
    patches: Vec<(String, String)>,
    cases: Vec<Phi3Case>,
}

#[derive(Deserialize)]
struct Phi3Case {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    add_special: bool,
    parse_special: bool,
    ids: Vec<u32>,
    detokenized: String,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf")
        .join(name)
}

fn record() -> Record {
    let text = std::fs::read_to_string(fixture("mistral_v3_vocab.json")).expect("record");
    serde_json::from_str(&text).expect("valid record")
}

fn load() -> (Tokenizer, Vec<Case>) {
    let tokenizer = Tokenizer::from_path(&fixture("mistral_v3_vocab.gguf")).expect("loads");
    let record = record();
    assert!(record.cases.len() >= 40, "the record has its cases");
    (tokenizer, record.cases)
}

/// Whether `text` holds the text of a control token (`[INST]`, `<s>`...):
/// Sluice always reads those as the token, llama.cpp only when asked.
fn has_control_text(tokenizer: &Tokenizer, text: &str) -> bool {
    tokenizer
        .inner()
        .get_added_tokens_decoder()
        .values()
        .any(|t| text.contains(t.content.as_str()))
}

#[test]
fn ids_equal_llama_cpp() {
    let (tokenizer, cases) = load();
    let mut checked = 0;
    for case in &cases {
        if !case.parse_special && has_control_text(&tokenizer, &case.text) {
            continue;
        }
        let ids = tokenizer
            .encode(&case.text, case.add_special)
            .expect("encodes");
        assert_eq!(
            ids, case.ids,
            "{:?} (add_special {})",
            case.text, case.add_special
        );
        checked += 1;
    }
    assert!(checked >= 45, "{checked} cases compared");
}

#[test]
fn bos_leads_and_ids_name_their_pieces() {
    let (tokenizer, _) = load();
    assert_eq!(tokenizer.bos_token_id(), Some(1));
    assert_eq!(tokenizer.eos_token_ids(), &[2]);
    assert_eq!(tokenizer.vocab_size(), 32768);
    assert_eq!(tokenizer.token_to_id("[INST]"), Some(3));
    assert_eq!(tokenizer.id_to_token(1).as_deref(), Some("<s>"));
}

#[test]
fn text_comes_back_as_llama_cpp_writes_it() {
    let (tokenizer, cases) = load();
    for case in cases.iter().filter(|c| !c.add_special) {
        let text = tokenizer.decode(&case.ids, false).expect("decodes");
        assert_eq!(text, case.detokenized, "{:?}", case.text);
    }
}

#[test]
fn phi3s_special_tokens_strip_the_whitespace_after_them_as_in_llama_cpp() {
    let phi3 = record().phi3;
    let mut bytes = std::fs::read(fixture("mistral_v3_vocab.gguf")).expect("fixture");
    for (old, new) in &phi3.patches {
        assert_eq!(old.len(), new.len());
        let (old, new) = (
            [&(old.len() as u64).to_le_bytes()[..], old.as_bytes()].concat(),
            [&(new.len() as u64).to_le_bytes()[..], new.as_bytes()].concat(),
        );
        let at = bytes
            .windows(old.len())
            .position(|w| w == old.as_slice())
            .expect("the string to patch");
        bytes[at..at + old.len()].copy_from_slice(&new);
    }
    let file = tempfile::Builder::new()
        .suffix(".gguf")
        .tempfile()
        .expect("temp file");
    std::fs::write(file.path(), bytes).expect("write");
    let tokenizer = Tokenizer::from_path(file.path()).expect("loads");
    assert!(phi3.cases.len() >= 3);
    for case in &phi3.cases {
        assert_eq!(
            tokenizer.encode(&case.text, true).expect("encodes"),
            case.ids,
            "{:?}",
            case.text
        );
    }
    // Without the Phi-3 name the whitespace stays (the unpatched file).
    let (plain, _) = load();
    let ids = plain.encode("[INST]\nHi", false).expect("encodes");
    assert_eq!(ids[0], 3);
    assert_ne!(ids[1], plain.encode("Hi", false).expect("encodes")[0]);
}
