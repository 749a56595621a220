"""Each MoE row of tests/unit/test_memory_plan.py's MEASURED (tmp_gpu/moe_rows.json), through memory_peak.run."""
import json, sys
sys.path.insert(0, "scripts")
import memory_peak
from trainer.log import setup_logging
setup_logging(0)
for name, argv in json.load(open("tmp_gpu/moe_rows.json")):
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    try:
        memory_peak.run(name, argv, False)
    except Exception as e:
        print("FAILED", name, repr(e)[:300], flush=True)
