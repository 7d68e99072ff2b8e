import sys, torch
from photon_core.ops import vision_attention_gluon as G
from photon_core.ops.vision_attention import vision_attention_reference
hd, heads, t = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
G.check_shape = lambda qkv, h: (qkv.shape[0], qkv.shape[1], qkv.shape[2] // (3 * h))
g = torch.Generator("cuda").manual_seed(1)
qkv = (torch.randn(3, t, 3 * heads * hd, device="cuda", generator=g) * 2).to(torch.bfloat16)
o = G.vision_attention_gluon(qkv, heads, (64, 64, 2, 0))
ref = vision_attention_reference(qkv.float(), heads)
print("hd", hd, "heads", heads, "err", ((o.float() - ref).abs().max() / ref.abs().max()).item(), flush=True)
