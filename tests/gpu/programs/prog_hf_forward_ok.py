"""A Hugging Face model's forward captured in a CUDA graph and replayed on new inputs: correct
use must give no finding. A small Llama built from a config (nothing downloaded); its int64
token ids and positions sit in small blocks that graphsan reads as possible pointer tables."""

from _prelude import *  # noqa: F403

try:
    import transformers
except ImportError:
    transformers = None
if transformers is None:
    out["skipped"] = "transformers is not installed"
    finish()
    raise SystemExit(0)

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
model = transformers.LlamaForCausalLM(config).cuda().eval()
ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
static_ids = ids.clone()
with torch.no_grad():
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (cuBLAS handles, lazy buffers)
        for _ in range(2):
            model(static_ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        logits = model(static_ids, use_cache=False).logits
    ok = True
    for _ in range(4):
        new = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
        static_ids.copy_(new)
        ok = ok and replay_guarded(g) == "replayed"
        ref = model(new, use_cache=False).logits
        ok = ok and bool(torch.allclose(logits, ref, atol=1e-3, rtol=1e-3))
out["ok"] = ok
out["healthy"] = healthy()
finish()
