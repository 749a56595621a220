"""The call() bodies of the inductor graphs holding all-to-alls in a TORCH_LOGS=output_code log, kernel lines only."""
import re, sys
text = open(sys.argv[1], errors="replace").read()
body = "\n".join(l.split("[__output_code]", 1)[1] for l in text.split("\n") if "[__output_code]" in l)
for k, part in enumerate(body.split("Output code:")):
    if "all_to_all_single.default(" not in part or "def call(" not in part:
        continue
    keep = [l for l in part[part.index("def call("):].split("\n")
            if re.search(r"extern_kernels|all_to_all_single\.default\(|wait_tensor\.default\(|triton_|\.run\(", l)
            and not l.strip().startswith(("#", "assert_"))]
    open(f"{sys.argv[2]}_{k}.txt", "w").write("\n".join(keep))
