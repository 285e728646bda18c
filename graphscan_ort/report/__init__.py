"""The report: answers drawn as one self-contained HTML page (no script, nothing fetched).

Beside the engines, below the commands that write a page (``report``, tune's
``--report``) and the pytest plugin's pages: ``html`` (the document), ``plots``
(matplotlib's charts as inline SVG, the optional extra ``report``), ``tune_view`` and
``views`` (each answer's sections), ``islands`` (the island map), ``page`` (a set of
answers on one page) and ``gate`` (the plugin's pages and index). Nothing here measures:
every figure is the answer's.
"""
