"""Draft sources behind one protocol (see `specjax.drafting.protocol.Drafter`)."""
