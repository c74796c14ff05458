"""Draft sources behind one protocol (see `specjax.drafters.base.Drafter`)."""
