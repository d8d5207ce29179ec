# Shared by the `make bench` experiment scripts: source it after setting ROOT.

# Sets SLUICE_BIN to a release `sluice`, building it unless one is given.
ensure_sluice_bin() {
  if [ -z "${SLUICE_BIN:-}" ]; then
    cargo build --release -p sluice
    SLUICE_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/sluice
  fi
}

# Waits up to 60 s for `sluice up` (pid $2, log $3) to answer $1/ready;
# exits the script with the log when it dies or never gets ready.
wait_ready() {
  local url=$1 pid=$2 log=$3
  for _ in $(seq 1 120); do
    curl -sf "$url/ready" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { echo "sluice up died:"; cat "$log"; exit 1; }
    sleep 0.5
  done
  echo "sluice up not ready after 60 s"; cat "$log"; exit 1
}

# Starts `$SLUICE_BIN up --http-port 0 ARGS...` with its log in $1; sets
# server_pid and addr (the address it reports binding) and waits until it
# is ready. Exits the script with the log when it never reports or dies.
start_sluice_up() {
  local log=$1; shift
  RUST_LOG=warn "$SLUICE_BIN" up --http-port 0 "$@" >"$log" 2>&1 &
  server_pid=$!
  addr=""
  for _ in $(seq 1 200); do
    addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$log" | head -1)
    [ -n "$addr" ] && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$addr" ] || { echo "sluice up reported no address:"; cat "$log"; exit 1; }
  wait_ready "http://$addr" "$server_pid" "$log"
}

