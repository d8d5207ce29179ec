//! Chat templates render here exactly as Hugging Face transformers renders
//! them: `fixtures/chat_templates.json` holds templates, messages, tools and
//! transformers' output (made by `fixtures/make_chat_template_fixture.py`).

use sluice_tokens::{ChatRenderOptions, ChatTemplate, TokensError};

#[test]
fn rendering_matches_transformers_fixture() {
    let text = include_str!("fixtures/chat_templates.json");
    let cases: Vec<serde_json::Value> = serde_json::from_str(text).expect("fixture is JSON");
    assert!(cases.len() >= 10, "fixture has its cases");
    for (i, case) in cases.iter().enumerate() {
        let field = |key: &str| {
            case[key]
                .as_str()
                .unwrap_or_else(|| panic!("case {i}: {key} is a string"))
        };
        let template = ChatTemplate::new(field("template"), field("bos"), field("eos"))
            .unwrap_or_else(|e| panic!("case {i} compiles: {e}"));
        let options = ChatRenderOptions {
            add_generation_prompt: case["agp"].as_bool().expect("agp is a bool"),
            tools: (!case["tools"].is_null()).then(|| case["tools"].clone()),
            extra: case["extra"].as_object().cloned().unwrap_or_default(),
        };
        let rendered = template.render_with(&case["messages"], &options);
        match (case.get("expected").and_then(|v| v.as_str()), rendered) {
            (Some(expected), Ok(got)) => assert_eq!(got, expected, "case {i}"),
            (None, Err(TokensError::TemplateRender(e))) => {
                let py = field("expected_error");
                assert!(
                    e.to_string().contains(py),
                    "case {i}: {e} carries transformers' message {py:?}"
                );
            }
            (expected, got) => panic!("case {i}: transformers gave {expected:?}, we gave {got:?}"),
        }
    }
}
