"""What one iteration launched and completed, as values (``records``), and the statistics made
from them once (``stats``)."""
