"""The asynchronous engine: W generation processes, T trainers and an evaluator over one buffer,
coordinated only through the buffer and published weights.
"""
