from services.forcer.main import main

main()
