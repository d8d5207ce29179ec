//! prefill
