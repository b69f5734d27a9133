"""The lint layer: the engine, the rule base and registry, the context, findings, settings and baselines.

(Named ``linter`` because ``qlint.lint`` is the public function.)
"""
