//! Flags every service takes. Flatten [`CommonArgs`] into a service's `Config`
//! with `#[command(flatten)]`; each flag also reads `SLUICE_<FLAG>`. The
//! security flags (TLS, mesh token, connection limits) are part of it:
//! see [`crate::security`].

use std::net::SocketAddr;

use crate::RuntimeError;
use crate::security::SecurityArgs;

/// Discovery and addressing flags shared by all services.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// etcd endpoint (e.g. http://127.0.0.1:2379). Unset: in-process discovery
    /// (only meaningful when every service runs in one process, as in `sluice up`).
    #[arg(long, env = "SLUICE_ETCD")]
    pub etcd: Option<String>,

    /// Discovery namespace; services only see instances in their namespace.
    #[arg(long, env = "SLUICE_NAMESPACE", default_value = "default")]
    pub namespace: String,

    /// Address to listen on; port 0 picks a free port.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Address others should dial; default: the bound address.
    #[arg(long, env = "SLUICE_ADVERTISE")]
    pub advertise: Option<String>,

    /// Lease time-to-live of this instance's discovery entry, in seconds.
    #[arg(long, env = "SLUICE_LEASE_TTL", default_value_t = 5)]
    pub lease_ttl: u32,

    /// Seconds to drain in-flight requests on shutdown before cancelling them.
    #[arg(long, env = "SLUICE_DRAIN_TIMEOUT", default_value_t = 10)]
    pub drain_timeout: u64,

    /// Seconds a peer whose discovery lease was lost (not deregistered) stays
    /// in this service's view, waiting for it to register again: an etcd
    /// pause or partition expires every lease at once, and its owners
    /// re-register within a second or two. 0: drop it at once.
    #[arg(long, env = "SLUICE_DISCOVERY_GRACE", default_value_t = 10)]
    pub discovery_grace: u64,
    /// Threads of this process's async runtime. Unset: the role's default,
    /// one for the queue and the router (their work per message is small,
    /// and one thread saves the wake-ups between threads that cost them more
    /// than the work at low load), one per core for every other role.
    #[arg(long, env = "SLUICE_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// TLS, mesh authentication and connection limits.
    #[command(flatten)]
    pub security: SecurityArgs,
}

impl CommonArgs {
    /// Checks the flags; errors name the flag and what to fix.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        if self.namespace.is_empty() || self.namespace.contains('/') {
            return Err(RuntimeError::InvalidFlag {
                flag: "--namespace",
                message: format!("{:?} must be non-empty and contain no '/'", self.namespace),
            });
        }
        if self.worker_threads == Some(0) {
            return Err(RuntimeError::InvalidFlag {
                flag: "--worker-threads",
                message: "must be at least 1 (leave it unset for the role's default)".into(),
            });
        }
        if self.lease_ttl < 1 {
            return Err(RuntimeError::InvalidFlag {
                flag: "--lease-ttl",
                message: "must be at least 1 second".into(),
            });
        }
        Ok(())
    }

    /// The async runtime's thread count: `--worker-threads`, else
    /// `role_default` (`None`: one per core).
    pub fn runtime_threads(&self, role_default: Option<usize>) -> Option<usize> {
        self.worker_threads.or(role_default)
    }

    /// [`Self::discovery_grace`] as a duration.
    pub fn grace(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.discovery_grace)
    }

    /// The address to register: `--advertise`, else the bound address.
    pub fn advertise_addr(&self, bound: SocketAddr) -> String {
        self.advertise.clone().unwrap_or_else(|| bound.to_string())
    }
}

impl Default for CommonArgs {
    fn default() -> Self {
        Self {
            etcd: None,
            namespace: "default".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            lease_ttl: 5,
            drain_timeout: 10,
            discovery_grace: 10,
            worker_threads: None,
            security: SecurityArgs::default(),
        }
    }
}

/// Which model a frontend or worker serves. Shared by both so that
/// `sluice up` takes `--model` once.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ModelArgs {
    /// Model directory in the Hugging Face layout (config.json,
    /// model.safetensors, tokenizer.json, tokenizer_config.json), or one
    /// GGUF file (llama.cpp's format: weights, tokenizer and chat template).
    /// `sluice up` writes and uses the built-in model when unset.
    #[arg(long, env = "SLUICE_MODEL")]
    pub model: Option<std::path::PathBuf>,

    /// Name clients use for the model; default: the directory's name (a
    /// GGUF file's name without `.gguf`).
    #[arg(long, env = "SLUICE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
}

impl ModelArgs {
    /// The model directory, or an error naming `--model`.
    pub fn dir(&self) -> Result<&std::path::Path, RuntimeError> {
        self.model.as_deref().ok_or(RuntimeError::InvalidFlag {
            flag: "--model",
            message:
                "a model directory or GGUF file is required (try `sluice model init --out DIR`)"
                    .into(),
        })
    }

    /// The served name: `--served-model-name`, else the directory's file name.
    pub fn name(&self) -> String {
        if let Some(n) = &self.served_model_name {
            return n.clone();
        }
        self.model
            .as_deref()
            .and_then(|p| match p.extension() {
                Some(ext) if ext.eq_ignore_ascii_case("gguf") => p.file_stem(),
                _ => p.file_name(),
            })
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "sluice-tiny".into())
    }
}
/// The items of a flag written `KEY<sep>VALUE,...` (e.g. `3=5,0=120` or
/// `0:1,3:1`), each side trimmed and parsed, in order; empty items are
/// skipped. An item without `sep`, a side that does not parse, or a key
/// named twice is an error naming the item and the expected `form`.
pub fn parse_pairs<K, V>(s: &str, sep: char, form: &str) -> Result<Vec<(K, V)>, String>
where
    K: std::str::FromStr + PartialEq + std::fmt::Display,
    K::Err: std::fmt::Display,
    V: std::str::FromStr,
    V::Err: std::fmt::Display,
{
    let mut pairs: Vec<(K, V)> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (key, value) = item
            .rsplit_once(sep)
            .ok_or_else(|| format!("{item:?} is not {form}"))?;
        let key: K = key
            .trim()
            .parse()
            .map_err(|e| format!("{:?} in {item:?}: {e}", key.trim()))?;
        let value: V = value
            .trim()
            .parse()
            .map_err(|e| format!("{:?} in {item:?}: {e}", value.trim()))?;
        if pairs.iter().any(|(k, _)| *k == key) {
            return Err(format!("{key} is listed twice"));
        }
        pairs.push((key, value));
    }
    Ok(pairs)
}

#[cfg(test)]
mod pairs_tests {
    use super::parse_pairs;

    #[test]
    fn pairs_parse_in_order_and_name_what_is_wrong() {
        let pairs = parse_pairs::<i32, f64>(" 3=5, -1=120 ,", '=', "PRIORITY=SECS").expect("valid");
        assert_eq!(pairs, vec![(3, 5.0), (-1, 120.0)]);
        let colon = parse_pairs::<i32, f64>("0:1,3:2", ':', "PRIORITY:WEIGHT").expect("valid");
        assert_eq!(colon, vec![(0, 1.0), (3, 2.0)]);
        let err = |s| parse_pairs::<i32, u32>(s, '=', "PRIORITY=MS").expect_err(s);
        assert!(err("3").contains("\"3\" is not PRIORITY=MS"));
        assert!(err("x=1").contains("\"x\" in \"x=1\""));
        assert!(err("1=-2").contains("\"-2\" in \"1=-2\""));
        assert!(err("1=2,1=3").contains("1 is listed twice"));
    }
}
