"""Code that more than one specd service needs: config, errors, model loading, KV sessions, gRPC plumbing.

Modules that import torch (models, kv, warping) are only imported by the draft and verify services;
the gateway uses the torch-free ones (errors, codec, tokenization, server, config).
"""
