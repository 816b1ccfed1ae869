"""The one engine builder: :mod:`.spec` says what to open, :mod:`.builder` opens it."""
