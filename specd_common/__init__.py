"""Code that every specd service shares, torch-free: config, errors, gRPC server plumbing, token
sessions, trees, grammar masks, distributions on the wire, telemetry and metrics. The gateway
imports only this; what runs a model lives in specd_engine (tests/test_layout.py holds both rules).
"""
