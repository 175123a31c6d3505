"""The training recipe: the LightningModule of one RL iteration (``module``), the resumable prompt stream
(``data``), the teacher weights of the self-distillation signals (``teacher``), held-out evaluation
(``evaluation``), MLflow tracking and provenance (``tracking``, ``provenance``) and ``train`` (the body of
``gearlab train``). May import everything below it; nothing below imports it."""
