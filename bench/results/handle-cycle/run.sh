#!/bin/bash
# alternate before (a57db86: the cycle) and after (79c0452: the fix), 2 rounds
ARGS=(e2e --model lm --steps 30 --sweep-steps 30 --lrs 4e-4 --clip-norm 0 --cases "ceiling (no traffic)" "DDP fp32" "bitps sync fp32" "bitps async fp32")
for round in 1 2; do
  for side in before after; do
    dir=/tmp/before; [ $side = after ] && dir=/work/main
    echo "$(date +%T) round $round $side start; /proc/stat: $(head -1 /proc/stat)"
    (cd $dir && .venv/bin/bitps-bench "${ARGS[@]}" --out /tmp/memfix/$side-$round --name e2e-lm-fp32-noclip > /tmp/memfix/$side-$round.log 2>&1)
    echo "$(date +%T) round $round $side rc $?"
  done
done
echo ALLDONE
