#!/bin/bash
cd /tmp/repo
export XSTAGE_GIT_COMMIT=f9b6e132c951161874b36c6e0f9b33e479128ba7 PYTHONPATH=/tmp/repo
python -m pytest -q -p no:cacheprovider tests/ops/moe/test_op_gpu.py tests/ops/moe/test_prefetch.py -k "prefetch or replays or never_synchronizes or host_reference" > /tmp/out/tests.log 2>&1
rc=$?; echo "tests rc=$rc" >> /tmp/out/job.status
if [ $rc -ne 0 ]; then touch /tmp/out/done; exit; fi
python -m xstage_lab.experiments.moe.layer_bench --settings ep8_rank --tokens 1 8 64 512 --no-progress --out /tmp/out/ep8.json > /tmp/out/ep8.log 2>&1; echo "ep8 rc=$?" >> /tmp/out/job.status
touch /tmp/out/done
