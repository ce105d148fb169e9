# Sourced by scripts/perf_hopper.sh and scripts/gpu8.sh: `run FILE COMMAND...` prints the command, runs it and keeps
# its raw output in $out/FILE (OUT_DIR, default docs/measurements/); `status` becomes 1 when any command failed, and
# the caller ends with `exit "$status"`, so every command runs even when one fails.
out="${OUT_DIR:-docs/measurements}"
mkdir -p "$out"
status=0
run() {
    local file="$1"
    shift
    echo "== $*" >&2
    "$@" 2>&1 | tee "$out/$file" || status=1
}
