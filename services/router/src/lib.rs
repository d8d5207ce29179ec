//! router
