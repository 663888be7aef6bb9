from specpilot.services.subagent.main import main

main()
