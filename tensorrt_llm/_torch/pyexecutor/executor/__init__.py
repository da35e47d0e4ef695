"""Around the step: the loop (thread, queue, health, death: ``loop``), the interface every
executor implements (``client``) and request validation before a request is queued."""
