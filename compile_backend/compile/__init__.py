"""The compile side: the Dynamo backend, splitting at breakpoints, piece
compilation."""
