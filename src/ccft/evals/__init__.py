"""Evaluation helpers: GSM8K answer extraction (``extract``) and bootstrap / pass@k statistics (``stats``)."""
