"""The numeric suite: where quantization error starts and which layers matter.

    from qlint.numeric.compare import compare
    from qlint.numeric.sensitivity import sensitivity
    from qlint.numeric.html import write_html

The runtime it stands on (layer matching, paired capture, streaming SQNR) is
``qlint.measure``, shared with lint's trial quantization. Modules: ``compare`` (the
per-layer report; findings QL301/QL302 come from ``diagnose``),
``sensitivity``, ``badcases``, ``profile`` and ``html``; the ``qlint compare`` command is
``qlint.cli.compare``. See docs/numeric-suite.md.

Nothing is imported here: several submodules share their main function's name
(``compare.compare``), and ``import qlint.numeric`` stays cheap for the CLI.
"""
