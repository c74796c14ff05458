"""What every drafter shares: the protocol (`protocol.Drafter`), the registry, draft shapes and layouts, the chain and
tree search. The methods live in `specjax.drafters`."""
