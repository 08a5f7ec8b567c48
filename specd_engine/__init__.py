"""The engine room: everything that runs a model, imported by the draft and verify services and
never by the gateway (tests/test_layout.py holds both rules).

  models        loading a model (the embedded GGUF, a folder), its device and dtype
  quantized     int4 decoder products and the int8 LM head (CPU)
  lean_forward  the forward pass of Llama-shaped models
  lm            CausalLM: one model for many sessions, every pass on the model thread
  sessions      a session (KVSession) and its part of a pass (Feed)
  passes        the pass engines: ragged (lean forward), transformers'; flat_pass the flat one (CUDA graphs)
  tuning        the runtime a pass runs on (threads, layout, serving trials) and the start-up tune
  layouts       CPU float32 weight layouts (SwitchableLinear)
  kv_cache      the KV cache that appends in place
  batching      the batcher that joins sessions' feeds into shared passes
  model_thread  the one thread that runs torch for a process
  autotune      the measurements that pick threads and weight layouts; runtime_cache keeps them
  features, head_files, warping
                target features on the wire, head weight files, sampling warps on logits

specd_common keeps what every service shares without torch (config, errors, gRPC plumbing,
sessions, trees, masks, telemetry). docs/design/engine-room.md says where the engine goes next.
"""
