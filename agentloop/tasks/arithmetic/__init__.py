"""The quick start's task: ``a op b`` problems solved with a ``calculator`` and a ``submit_answer`` tool.

``data`` builds the rows, ``tools`` holds the two tools, ``reward`` scores a final answer and
``warm_start`` teaches the tiny model the tool protocol before reinforcement
(``config/arithmetic_grpo.yaml`` names each of them).
"""
