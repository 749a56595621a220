"""GEMMs inside each all-to-all's window (start .. wait) in every inductor graph of a TORCH_LOGS=output_code log.
    python3 tmp_gpu/windows.py LOG"""
import re, sys
text = open(sys.argv[1], errors="replace").read()
lines = [l.split("[__output_code]", 1)[1] if "[__output_code]" in l else None for l in text.split("\n")]
graphs, body = [], None
for l in lines:
    if l is None:
        continue
    if "Output code:" in l:
        body = []
        graphs.append(body)
    elif body is not None:
        body.append(l)
for i, g in enumerate(graphs):
    code = "\n".join(g)
    if "def call(" not in code or "all_to_all_single" not in code:
        continue
    windows, started, kinds = [], {}, {}
    for line in code[code.index("def call("):].split("\n"):
        if line.strip().startswith(("#", "assert_")):
            continue
        s = re.match(r"\s*(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(", line)
        w = re.search(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)", line)
        if s:
            started[s.group(1)] = []
        elif w and w.group(1) in started:
            windows.append(started.pop(w.group(1)))
        else:
            m = re.search(r"extern_kernels\.(mm|addmm|_grouped_mm|bmm|_scaled_mm)\(|torch\.ops\.aten\.(_scaled_mm|_grouped_mm)", line)
            if m:
                for b in started.values():
                    b.append(m.group(1) or m.group(2))
    print(f"graph {i}: {len(windows)} all-to-alls, GEMMs inside each: {[len(w) for w in windows]} {windows}")
