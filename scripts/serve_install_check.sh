#!/usr/bin/env bash
# What `make serve` installs, tested alone: a fresh venv from the serve set-up (scripts/setup_env.sh serve:
# requirements-serve.txt, torch, the build; no test tooling), from a copy of this tree, running the commands a user
# runs: `clef-serve --help`, `clef-serve batch --help`, `clef-serve batch` on a file of the embedded model, and the
# server, which must become ready and answer the README's request. A dependency only the test venv has (httpx for
# the batch command, once) fails here, whatever the tests import. CI runs it (.ci/run).
#
# Cost on 2 cores: torch from pip's cache ~1-2 min, the CPU kernels' build ~3 min (no GPU: the serve set-up builds
# no CUDA kernels), the commands ~1 min.
#
#   VENV=path (default: a temporary one, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'kill "${server:-}" 2>/dev/null || true; rm -rf "$work"' EXIT
VENV=${VENV:-$work/venv}

# A copy of the tree (tracked and untracked-but-not-ignored files): the editable install builds its extension in
# the source tree, which must not replace the test venv's.
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$work" --one-top-level=src
cd "$work/src"
VENV="$VENV" bash scripts/setup_env.sh serve
CLEF="$VENV/bin/clef-serve"
PY="$VENV/bin/python"
echo "== in $VENV: $("$PY" -m pip list --format=freeze 2>/dev/null | grep -c .) packages"
! "$PY" -c "import pytest" 2>/dev/null || { echo "FAIL: the serve venv holds test tooling (pytest)"; exit 1; }

echo "== clef-serve --help, clef-serve batch --help"
"$CLEF" --help | grep -q "clef-serve batch" || { echo "FAIL: clef-serve --help does not name the batch command"; exit 1; }
"$CLEF" batch --help >/dev/null

echo "== clef-serve batch on the embedded model"
python_request='{"model": "clef-tiny", "state": "09:12:01 INFO api: request served\n09:12:04 ERROR db: connection refused",
 "questions": {"last_error": {"type": "noul", "instructions": "Is the last log line an ERROR?"}}}'
printf '%s\n' "$(echo "$python_request" | tr -d '\n')" > "$work/in.jsonl"
printf '{"custom_id": "second", "body": %s}\n' "$(echo "$python_request" | tr -d '\n')" >> "$work/in.jsonl"
"$CLEF" batch "$work/in.jsonl" "$work/out.jsonl" --no-progress --autotune off
"$PY" - "$work/out.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 2, rows
for row in rows:
    body = row.get("response", {}).get("body", row)
    assert 0.0 <= body["answers"]["last_error"]["noul"] <= 1.0, row
print("== batch: 2 rows answered")
EOF

echo "== clef-serve on the embedded model: /ready, then the README's request"
port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$CLEF" --host 127.0.0.1 --p "$port" --autotune off > "$work/serve.log" 2>&1 &
server=$!
"$PY" - "$port" "$work/serve.log" <<'EOF'
import json, re, sys, time, urllib.error, urllib.request
port, log = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(base + "/ready", timeout=5) as ready:
            if ready.status == 200:
                break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    if time.monotonic() > deadline:
        sys.exit(f"FAIL: not ready within 300 s:\n{open(log).read()[-3000:]}")
    time.sleep(1)
readme = open("README.md").read()
example = re.search(r"<!-- readme-example -->\n```\n\$ curl .*?-d '(.*?)'\n(\{.*?\})\n```", readme, re.S)
request = urllib.request.Request(
    base + "/v1/systemone", data=example[1].encode(), headers={"Content-Type": "application/json"}
)
with urllib.request.urlopen(request, timeout=60) as response:
    answers = json.load(response)["answers"]
printed = json.loads(example[2])["answers"]
assert answers.keys() == printed.keys(), (answers, printed)
assert answers["last_failure"]["choice"] == printed["last_failure"]["choice"], answers
print("== server: ready, the README's request answered", json.dumps(answers)[:120], "...")
EOF
echo "== the serve install runs the batch command and the server"
