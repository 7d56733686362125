"""A built-in visual task: name the colour of each picture, over two turns; the answer is only in the pixels.

``data`` draws the pictures and builds the rows, ``env`` shows the next picture and judges each answer,
``reward`` reads a colour answer and ``warm_start`` teaches the tiny vision-language model the answer
format (one colour initial, R, G or B, then the end of the turn) with answers that ignore the picture, so
reinforcement has one thing to learn: look at the image (``config/vlm_grpo.yaml`` names each of them).
"""
