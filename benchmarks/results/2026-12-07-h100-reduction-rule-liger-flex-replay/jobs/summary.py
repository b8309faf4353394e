"""One line per record of $OUT: tokens/s, MFU, peak GPU memory, the last two losses."""
import glob
import json
import os

for path in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    try:
        record = json.load(open(path))
        results = record["results"]
        print(os.path.basename(path), round(results["tokens_per_s"]), results.get("mfu"),
              results.get("peak_memory_gib"), record.get("steps", {}).get("losses", [])[-2:])
    except (KeyError, TypeError, ValueError) as e:
        print(os.path.basename(path), "unreadable:", e)
