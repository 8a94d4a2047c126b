"""slimgrad.nn"""
