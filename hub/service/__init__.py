"""The running hub's state, held by three owners (Membership, Leasing, Intake; HubState builds them), the node
protocol's handlers that call them, the status board and web page, and the hub's own local rollouts."""
