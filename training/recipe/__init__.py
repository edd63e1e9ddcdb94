"""The user's code: a recipe loaded only from what the worker allows (``loader``), its optional hooks read once
(``hooks``) and the run context it sees (``context``)."""
