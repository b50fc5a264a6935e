import subprocess, sys, os, torch
from slime.utils.weight_transport import serialize_named_tensors
t = torch.arange(10., device="cuda")
s = serialize_named_tensors([("w", t), ("v", torch.ones(3, 4, device="cuda", dtype=torch.bfloat16))])
code = "import sys\nfrom slime.utils.weight_transport import deserialize_named_tensors\nnt = deserialize_named_tensors(sys.stdin.read())\nprint([(n, str(x.device), x.float().sum().item()) for n, x in nt])"
r = subprocess.run([sys.executable, "-c", code], input=s, capture_output=True, text=True, timeout=120)
print("CUDA IPC:", r.stdout.strip(), r.stderr[-2000:])
