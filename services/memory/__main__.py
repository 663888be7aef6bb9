from specpilot.services.memory.main import main

main()
