"""Where a model stored in humming's layout parts from the dequantized reference, layer by layer (GPU)."""
import torch

from qerl.formats import NVFP4
from qerl.kernels import humming_backend as hb, settings
from qerl.layers.fused_group import fused_groups
from qerl.model import qwen25_config, quantized_layers, random_policy

with settings.use(humming_storage=True):
    pol = random_policy(qwen25_config("qwen2.5-0.5b", 1), "nvfp4", lora_rank=0, device="cuda", progress=False)
x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16)
for name, g in fused_groups(pol.model):
    w = g.fmt.dequantize(g.tensors, g.shape, torch.bfloat16)
    xx = torch.randn(64, g.shape[1], device="cuda", dtype=torch.bfloat16)
    y = hb.stored_matmul(xx, g.fmt, g.tensors, g.shape)
    ref = xx.float() @ w.float().T
    print("group", name, g.shape, g.tensors["weight_packed"].is_contiguous(), float((y.float() - ref).norm() / ref.norm()))
    std = [m.checkpoint_tensors() for m in g.members]
    wm = torch.cat([NVFP4().dequantize(t, m.weight_shape) for t, m in zip(std, g.members)])
    print("  dequant(group) == cat(dequant(members))", torch.equal(w, wm))
for name, m in quantized_layers(pol.model):
    if m.group is not None:
        continue
    t = m.quant_tensors()
    xx = torch.randn(64, m.in_features, device="cuda", dtype=torch.bfloat16)
    y = hb.stored_matmul(xx, m.fmt, t, m.weight_shape)
    ref = xx.float() @ m.dequantized_weight(torch.float32).T
    print("layer", name, m.weight_shape, float((y.float() - ref).norm() / ref.norm()))
n, k = 896, 896
cfg_t = hb._layer_config(n, k, torch.device("cuda", 0))
ct = NVFP4().quantize((torch.randn(n, k, device="cuda") * 0.02).bfloat16())
real = hb.HummingWeight.build("nvfp4", ct, (n, k)).layer.humming_config
print("configs equal:", cfg_t.to_str() == real.to_str())
if cfg_t.to_str() != real.to_str():
    print(cfg_t.to_str()); print(real.to_str())
