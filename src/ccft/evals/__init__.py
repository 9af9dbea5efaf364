"""ccft.evals: the evaluation layer (docs/design.md, "Layers").

Tasks (``tasks`` registry, ``task_base`` API; GSM8K, GSM-Plus, HumanEval(+), BFCL multiple, MultiPL-E),
answer extraction and statistics (``extract``, ``stats``), sandboxed execution (``sandbox``,
``execution``), the eval runner behind ``ccft eval`` and ``ccft demo`` (``runner`` and its parts:
``settings``, ``prompting``, ``generation``, ``scoring``, ``records``, ``results``), the sharing-ratio
sweep (``sharing``, ``sweep``), reports (``report``) and the lm-eval model (``lm_eval_model``).
"""
