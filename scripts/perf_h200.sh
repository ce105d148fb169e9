#!/usr/bin/env bash
# The old name of scripts/perf_hopper.sh (which runs on any Hopper card, H100 or H200): runs it with the same
# arguments and environment.
exec bash "$(dirname "$0")/perf_hopper.sh" "$@"
