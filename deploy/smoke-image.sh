#!/usr/bin/env bash
# Runs a built image the way compose.yaml does, without compose: the demo's team and two more
# engines (two machines' host names and state folders) on one PostgreSQL database, each in its
# own container, then checks that handoffs go round and that more than one engine served
# recipients. For a Docker host without compose, or podman (DOCKER=podman). Needs python3.
#
#   deploy/smoke-image.sh IMAGE POSTGRES_URL
#
# POSTGRES_URL names an empty database the containers reach over the host's network
# (--network host), e.g. postgres://handoffs:handoffs@127.0.0.1:5432/team. On the host's
# network the page's peer is loopback: the published-port path (--allow-peer) is not tried.
set -euo pipefail
image=${1:?usage: deploy/smoke-image.sh IMAGE POSTGRES_URL}
db=${2:?usage: deploy/smoke-image.sh IMAGE POSTGRES_URL}
docker=${DOCKER:-docker}
names=(handoffs-smoke-team handoffs-smoke-a handoffs-smoke-b)
passed=""
cleanup() {
  if [ -z "$passed" ]; then
    for n in "${names[@]}"; do
      echo "--- $n"
      $docker logs "$n" 2>&1 | tail -20 || true
    done
  fi
  for n in "${names[@]}"; do $docker rm -f "$n" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
for n in "${names[@]}"; do $docker rm -f "$n" >/dev/null 2>&1 || true; done

user=$($docker image inspect -f '{{.Config.User}}' "$image")
case "$user" in
  "" | 0 | root | 0:* | root:*) echo "the image runs as root ($user)"; exit 1 ;;
esac
echo "runs as $user: $($docker run --rm "$image" --version)"
# An empty database: counts left by an earlier run would pass this one.
if $docker run --rm --network host -e HANDOFFS_DB="$db" "$image" status --json >/dev/null 2>&1; then
  echo "the database already holds handoffs' tables: give an empty one"
  passed=no-logs
  exit 1
fi

start() {
  local name=$1 host=$2
  shift 2
  $docker run -d --name "$name" --network host -e HANDOFFS_DB="$db" -e HANDOFFS_HOST="$host" \
    -e RUST_LOG=info "$image" "$@" >/dev/null
}
start handoffs-smoke-team team demo --port 0
sleep 5
start handoffs-smoke-a machine-a run
start handoffs-smoke-b machine-b run

engines=""
returned=0
for _ in $(seq 1 90); do
  sleep 1
  for n in "${names[@]}"; do
    if [ "$($docker inspect -f '{{.State.Running}}' "$n")" != true ]; then
      echo "$n stopped"
      exit 1
    fi
  done
  status=$($docker run --rm --network host -e HANDOFFS_DB="$db" "$image" status --json)
  seen=$(printf '%s' "$status" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(" ".join(sorted({l["engine"].split("/")[0] for l in d["leases"]})))')
  engines=$(printf '%s\n' $engines $seen | sed '/^$/d' | sort -u | tr '\n' ' ')
  returned=$(printf '%s' "$status" | python3 -c '
import json, sys
print(dict(json.load(sys.stdin)["counts"]).get("RETURNED", 0))')
  if [ "$returned" -ge 10 ] && [ "$(echo $engines | wc -w)" -ge 2 ]; then
    echo "$returned handoffs returned; engines that held leases: $engines"
    passed=yes
    exit 0
  fi
done
echo "after 90 s: $returned handoffs returned; engines that held leases: ${engines:-none}"
exit 1
