#!/usr/bin/env bash
# Written tok/s of `python -m experiments.regen` on ONE H200 (kind nvidia-h200), two ways on the same weights:
#     bash benchmarks/gpu/regen_server.sh
# 1. save:    a random Qwen3.6-27B-shaped target (LAYERS of its 64 layers, default 16: a 13 GB bf16 folder that
#             saves and loads in a call) as a Hugging Face folder with the tiny chat tokenizer, in WORK;
# 2. builtin: the built-in writer (`experiments.regen`, the target on this GPU) writes BATCHES shards;
# 3. server:  `transformers serve` of that folder on the same GPU (CB=1: its continuous batching) and
#             `experiments.regen backend=openai` writing the same number of shards through it, CONC requests at once;
# then a table of both written tok/s (each run's `perf/write_tok_s`). Logs and the table come back in
# $OUT/regen_server. Not measured in this repository yet: the lead runs it.
# Env: LAYERS, SEQ (data.max_len, default 2048), BATCHES (default 2), CONC (server.concurrency, default 64), CB
# (default 1), PORT (default 8011), DEVICE (default cuda:0; cpu with TARGET set to a tiny target for a dry run:
# TARGET="+target=tiny_random_chat target.random.hidden_size=64 target.random.num_layers=4
#  target.random.intermediate_size=128 target.random.head_dim=16 target.random.linear_head_dim=16 target.layer_ids=[0,1,2]"
#  DEVICE=cpu SEQ=64 PROMPT=48 CB=0 EXTRA=data.online.write_batch=8), EXTRA (more run overrides), PY (python). Wheels: transformers[serving] (openai, fastapi, uvicorn,
# accelerate) besides the conversations benchmark's (benchmarks/gpu/conversations.sh).
set -uo pipefail
OUT=${OUT:-gpu_out}
W=${WORK:-gpu_work/regen_server}
mkdir -p "$W" "$OUT/regen_server" && W=$(cd "$W" && pwd)
source "$(dirname "$0")/../leased_gpu/job_env.sh"
PY=${PY:-python}
SEQ=${SEQ:-2048}
BATCHES=${BATCHES:-2}
PORT=${PORT:-8011}
DEVICE=${DEVICE:-cuda:0}
TARGET=${TARGET:-"+target=qwen3_6_27b_random target.tokenizer=builtin:tiny_chat target.mask_token_id=2 \
target.random.num_layers=${LAYERS:-16}"}
DATA="+data=conversations data.path=$PWD/benchmarks/data/conversations_sample.jsonl data.conversations.responses=target \
      data.max_len=$SEQ data.pool.max_prompt_len=${PROMPT:-256} data.conversations.cache_dir=$W/hf \
      data.conversations.coding10_chat=false regen.batches=$BATCHES regen.progress=false target.path=$W/ckpt ${EXTRA:-}"
rate() { grep -o 'perf/write_tok_s=[0-9.e+]*' "$1" | tail -1 | cut -d= -f2; }

echo "== 1/3 save the target as a Hugging Face folder" >&2
if [ ! -f "$W/ckpt/config.json" ]; then
  $PY - "$W/ckpt" $TARGET > "$W/save.log" 2>&1 <<'EOF' || { tail -20 "$W/save.log"; exit 1; }
import shutil, sys, torch
from experiments.config import compose_config
from dflash.target.model import ASSETS, build_random_model
cfg = compose_config(sys.argv[2:])
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
build_random_model(cfg.target.random, dev, dtype).save_pretrained(sys.argv[1])
for f in (ASSETS / "tiny_chat").iterdir():
    shutil.copy(f, sys.argv[1])
EOF
fi

echo "== 2/3 the built-in writer" >&2
$PY -m experiments.regen $TARGET $DATA data.online.shard_dir=$W/builtin > "$W/builtin.log" 2>&1
echo "builtin: rc $? $(tail -1 "$W/builtin.log")"

echo "== 3/3 transformers serve on the same GPU, and regen backend=openai through it" >&2
CBFLAG=$([ "${CB:-1}" = 1 ] && echo --continuous-batching || echo "")
$PY -c "from transformers.cli.transformers import main; main()" serve "$W/ckpt" --host 127.0.0.1 --port $PORT \
  --device $DEVICE --dtype auto $CBFLAG > "$W/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || break
  sleep 1
done
$PY -m experiments.regen $TARGET $DATA data.online.shard_dir=$W/server backend=openai \
  url=http://127.0.0.1:$PORT/v1 server.concurrency=${CONC:-64} > "$W/server.log" 2>&1
echo "server: rc $? $(tail -1 "$W/server.log")"
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null

{ echo "| writer | written tok/s |"; echo "| --- | --- |"
  echo "| built-in (\`experiments.regen\`) | $(rate "$W/builtin.log") |"
  echo "| \`transformers serve\` (CB=${CB:-1}), ${CONC:-64} requests at once | $(rate "$W/server.log") |"
} | tee "$OUT/regen_server/table.md"
cp "$W"/*.log "$OUT/regen_server/" 2>/dev/null
