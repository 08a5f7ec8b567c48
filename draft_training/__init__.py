"""Offline draft training (`specd train-draft`): the target's own answers, their features, an EAGLE-style
feature head trained on them, and a simulated-speculation evaluation. Serving code never imports this package;
it imports the serving packages (the head it trains is draft_service.feature_head).
"""
