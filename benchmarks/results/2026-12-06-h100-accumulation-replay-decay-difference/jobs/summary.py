import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    try:
        d = json.load(open(f)); r = d["results"]
        print(os.path.basename(f), round(r["tokens_per_s"]), r.get("mfu"), r.get("peak_memory_gib"), d.get("steps", {}).get("losses", [])[-2:])
    except Exception as e:
        print(os.path.basename(f), "unreadable:", e)
