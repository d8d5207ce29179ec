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

fn load() -> (Tokenizer, Vec<Case>) {
    let tokenizer = Tokenizer::from_path(&fixture("mistral_v3_vocab.gguf")).expect("loads");
    let text = std::fs::read_to_string(fixture("mistral_v3_vocab.json")).expect("record");
    let record: Record = serde_json::from_str(&text).expect("valid record");
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
