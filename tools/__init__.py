"""Tools above the engine: make and train models, benchmark them, plan memory.

make_model: random checkpoints with transformers' classes · demo: the shipped demo models and their
training · bench: `pagechat bench` · bench_quant: `pagechat bench-quant` · planner: `pagechat plan`.
"""
