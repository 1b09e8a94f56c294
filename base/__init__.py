"""jaxdist.base: the shared base every role imports.

The exception hierarchy (:mod:`jaxdist.base.errors`, which imports nothing of
jaxdist and may be imported by every layer), the task process (flags, ready
line, signals, drain: :mod:`jaxdist.base.task_process`), the Prometheus
exporter (:mod:`jaxdist.base.monitoring`), cluster resolvers
(:mod:`jaxdist.base.cluster_resolver`), the input context handed to input
functions (:mod:`jaxdist.base.input_context`) and files written atomically
(:mod:`jaxdist.base.files`). It may import only
:mod:`jaxdist.proto` and :mod:`jaxdist.transport`; see the README's Layout.
"""
