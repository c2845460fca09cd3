"""Small synthetic simulator profiles shared by the unit and end-to-end tests.

The cost model is not the subject where these are used, so the coefficients are chosen to make
expected times easy to compute by hand.
"""

STEP = {"base_s": 0.01, "per_prefill_token_s": 1e-3, "per_prefill_attn_pair_s": 0.0,
        "per_decode_seq_s": 2e-3, "per_decode_context_token_s": 0.0}


def profile_dict(step=None, num_kv_blocks=1000, max_num_seqs=64, budget=2048, kv_bytes=1000, num_layers=4):
    role = {"num_threads": 1, "num_kv_blocks": num_kv_blocks, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": budget, "step": dict(step or STEP)}
    return {"version": 1, "model": "synthetic", "dtype": "bfloat16", "block_size": 16,
            "kv_bytes_per_token": kv_bytes, "embed_bytes_per_token": 1000, "num_layers": num_layers,
            "roles": {"colocated": dict(role), "prefill": dict(role), "decode": dict(role),
                      "encode": {"num_threads": 1, "tokens_per_tile": 16, "image": {"base_s": 0.002, "per_tile_s": 0.05}}}}
